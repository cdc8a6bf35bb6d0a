"""Where the daemon's state lives on disk, and how it is written.

The state directory (`statedir`: private, locked), the SQLite store of one host (`sqlite`), the interface
every store implements (`store`: SQLite here, etcd in `exod.cluster.etcd_state`), the journal that writes
the controller's changes to it in order (`journal`), and what the directory keeps and for how long
(`retention`). It imports nothing of the daemon: it stores what it is given and decides nothing.
"""
