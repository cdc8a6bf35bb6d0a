"""Several hosts on etcd: only with ``exod serve --cluster``; one host never calls into it.

The etcd client (`etcd`), a node's record under its lease (`nodes`), the controller's election and its
guarded writes (`election`), this daemon as a member (`membership`), the agent that runs the ranks placed
on this node (`agent`), the controller's side of the other nodes (`remote`), the cluster's state in etcd
(`etcd_state`), and a whole cluster on one machine for demos and tests (`devcluster`).

It builds on this host (`exod.host`), the stores (`exod.state`) and the runner's protocol; the controller
and the API use it, never the other way round.
"""
