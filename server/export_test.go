package server

// AppendLease exposes appendLease to the package's external tests.
var AppendLease = appendLease
