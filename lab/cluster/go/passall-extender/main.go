// The bench's minimal scheduler extender: every candidate node passes, every score is 0.
// Bench figures 19c and 25j point the same kube-scheduler at it and at archway's extender, so the
// ratio of their bind rates is what archway's own serving costs the scheduler.
package main

import (
	"encoding/json"
	"log"
	"net/http"
	"os"
)

type extenderArgs struct {
	Pod       json.RawMessage
	Nodes     json.RawMessage
	NodeNames *[]string
}

func filter(w http.ResponseWriter, r *http.Request) {
	var args extenderArgs
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<20)).Decode(&args); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	nodes := args.Nodes
	if len(nodes) == 0 {
		nodes = json.RawMessage("null")
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"Nodes": nodes, "NodeNames": args.NodeNames,
		"FailedNodes": map[string]string{}, "FailedAndUnresolvableNodes": map[string]string{},
		"Error": ""})
}

func prioritize(w http.ResponseWriter, r *http.Request) {
	var args extenderArgs
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<20)).Decode(&args); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write([]byte("[]"))
}

func main() {
	if len(os.Args) != 2 {
		log.Fatal("usage: passall-extender HOST:PORT")
	}
	http.HandleFunc("/scheduler/filter", filter)
	http.HandleFunc("/scheduler/prioritize", prioritize)
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) })
	log.Fatal(http.ListenAndServe(os.Args[1], nil))
}
