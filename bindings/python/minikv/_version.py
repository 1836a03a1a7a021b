# Generated from include/minikv.h by scripts/version.sh: do not edit.
VERSION = "0.1.0"
