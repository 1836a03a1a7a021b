module minikv.dev/minikv

go 1.19
