// A real static program the tests turn into a binary no kernel here runs (its ELF machine
// rewritten), so a container of it fails with a real exec format error.
package main

import "fmt"

func main() { fmt.Println("hello from a binary this machine runs") }
