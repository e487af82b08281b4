// A long-running container for the two-architecture tier: says which architecture it was built
// for (and so runs on: the VM node registers no emulator), then waits to be stopped.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"
)

func main() {
	fmt.Printf("running on %s/%s\n", runtime.GOOS, runtime.GOARCH)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
