"""What this machine has: its runner processes, its ring ports, its model cache, its memory.

One supervisor per runner process (`supervisor`), the runners a killed daemon left behind (`orphans`),
one generation's ports and hostfile (`ring`), models resolved in this host's Hugging Face cache
(`models`, and the generated test model `tiny_model`), the memory models may use (`memory`). It runs what
it is told to and decides nothing: it imports the state directory (`exod.state`) and the runner's
protocol, never the controller, the cluster or the API.
"""
