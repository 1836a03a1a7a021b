module minikv.dev/examples/go

go 1.19

require minikv.dev/minikv v0.0.0

// The binding in this repository (no module proxy needed).
replace minikv.dev/minikv => ../../bindings/go
