"""The gate: pods the webhook admitted behind archway's scheduling gate (their images unread in
time) are placed and released by the gate controller; the one leading controller also learns from
what runs (remediation, tagwatch). process (the controller's process: one leader by a Lease, and
each leadership's wiring), controller (what the leader does with gated pods), release (the one
update that releases a pod, pure), cli (`archway gate release-all`), remediation and tagwatch
(the closed loop, sharing leaderloop; remediation stands on podstatus, failingpods, logreads and
eviction), unseen (pods archway never saw), daemonsets (a DaemonSet told which nodes cannot
run it), recordkeeper (the image records' care). `archway serve` keeps the controller's process
running beside gunicorn's master (archway.server.supervisor)."""
