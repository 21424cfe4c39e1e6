// Package heartbeat keeps sandboxes as leases: the sweeper that stops (never deletes) sandboxes
// whose client stopped heartbeating, the expiry warnings before it does, optional retention of
// stopped sandboxes, the leader lock that lets one broker sweep at a time, and the orphan report.
//
// Heartbeats themselves are one atomic Redis step in the store (store.Heartbeat); every deadline
// decision here is made on the store's lease clock (Redis TIME, a hand-moved clock in tests), never
// the broker's. It must not know HTTP.
package heartbeat
