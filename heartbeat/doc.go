// Package heartbeat keeps sandboxes as leases: the sweeper that stops (never deletes) sandboxes
// whose client stopped heartbeating, the expiry warnings before it does, optional retention of
// stopped sandboxes, the leader lock that lets one broker sweep at a time, and the orphan report.
//
// Heartbeats themselves are one atomic Redis step in the store (store.Heartbeat); every time used
// here comes from an injectable clock. It must not know HTTP.
package heartbeat
