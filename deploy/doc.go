// Package deploy holds Waymark's deployment files and no code: nats/
// (nats-server configurations for a 3-node JetStream cluster and a single
// node), helm/ (values for the official NATS Helm chart), k8s/
// (Deployments of engines and workers, their Service, Secrets and a KEDA
// ScaledObject) and systemd/ (units for bare metal).
//
// Its tests check those files offline so that they cannot rot: the NATS
// configurations go through nats-server's own loader, the Kubernetes
// manifests are decoded strictly into k8s.io/api types (the ScaledObject
// and the Helm values into local mirrors of the fields they use), the
// systemd units are parsed with go-systemd, and every engine and worker
// command line is parsed by the real commands' flags, so that a renamed
// flag fails the suite.
package deploy
