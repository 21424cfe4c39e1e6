package kube

// SharedCluster is the package's test cluster, for the external tests.
var SharedCluster = cluster
