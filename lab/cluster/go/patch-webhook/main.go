// The bench's minimal mutating admission webhook: it decodes the AdmissionReview and the pod in
// it (metadata, containers' images) as any webhook must, and allows the pod with a fixed JSON
// patch, PATCHFILE's bytes. Bench figure 1d gives it the patch archway wrote for the same review
// and measures the server CPU one admission costs each, so the ratio is what archway's own work
// (its Python, its lookups in cache, its decision) costs over Go's bare HTTPS and JSON.
package main

import (
	"crypto/tls"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net/http"
	"os"
)

const maxBody = 3 << 20 // the apiserver's limit on a request to a webhook

type container struct {
	Name  string `json:"name"`
	Image string `json:"image"`
}

type pod struct {
	Metadata struct {
		Name         string            `json:"name"`
		GenerateName string            `json:"generateName"`
		Namespace    string            `json:"namespace"`
		Labels       map[string]string `json:"labels"`
		Annotations  map[string]string `json:"annotations"`
	} `json:"metadata"`
	Spec struct {
		InitContainers []container `json:"initContainers"`
		Containers     []container `json:"containers"`
	} `json:"spec"`
}

type review struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Request    *struct {
		UID    string `json:"uid"`
		Object pod    `json:"object"`
	} `json:"request"`
}

type response struct {
	UID       string `json:"uid"`
	Allowed   bool   `json:"allowed"`
	PatchType string `json:"patchType"`
	Patch     []byte `json:"patch"` // encoding/json writes []byte as base64
}

func answer(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body)
}

func mutate(patch []byte) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			answer(w, http.StatusMethodNotAllowed, map[string]string{"error": "POST only"})
			return
		}
		var in review
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		if err == nil {
			err = json.Unmarshal(body, &in)
		}
		if err == nil && in.Request == nil {
			err = errors.New("no request")
		}
		if err != nil {
			answer(w, http.StatusBadRequest, map[string]string{"error": "bad AdmissionReview: " + err.Error()})
			return
		}
		answer(w, http.StatusOK, map[string]any{"apiVersion": in.APIVersion, "kind": "AdmissionReview",
			"response": response{in.Request.UID, true, "JSONPatch", patch}})
	}
}

func main() {
	if len(os.Args) != 5 {
		log.Fatal("usage: patch-webhook ADDRESS CERT KEY PATCHFILE")
	}
	patch, err := os.ReadFile(os.Args[4])
	if err != nil {
		log.Fatal(err)
	}
	http.HandleFunc("/mutate", mutate(patch))
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		answer(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	server := &http.Server{Addr: os.Args[1], TLSConfig: &tls.Config{MinVersion: tls.VersionTLS12}}
	log.Fatal(server.ListenAndServeTLS(os.Args[2], os.Args[3]))
}
