"""The cluster: one model over several Macs, as a pipeline of stages or one tensor-parallel
MLX group. Installed as `kimi_mlx.cluster`; every command enters through `kimi-mlx cluster`
(`kimi_mlx.commands.main` -> `cluster.cli.run`, one subcommand each).

The processes, the modules that run in each, and where each starts:

HTTP head, pipeline -- the Mac the clients call.
    entry: `kimi-mlx cluster server` -> `cli.run` -> `server.run` -> `head.engine.ClusterEngine`
    modules: `server`, `head.engine`, `head.cluster`, `head.plan`, `head.pipeline`,
    `head.transport`, `head.leases`, `head.batcher`, `head.speculative`, `head.recovery`,
    `net.session`, `net.nodes`, `net.control`, `net.cache_index`; the HTTP API of `kimi_mlx.server`.

HTTP head, tensor (`--parallel tensor`) -- the Mac the clients call; runs the request path
(tokenizer, sampling, batching) while rank 0's share of the group runs in its child.
    entry: `kimi-mlx cluster server --parallel tensor` -> `server.run` ->
    `tensor.engine.start_tensor_engine`
    modules: `server`, `tensor.engine`, `tensor.recovery` (its keeper), `tensor.launch`,
    `tensor.group`, `tensor.batched`, `tensor.rows`, `tensor.prefill`, `tensor.step` and
    `tensor.wire` (commands), `net.session`, `net.nodes`, `net.cache_index`.

Tensor rank 0 child -- a child of the tensor HTTP head (MLX forms one distributed group per
process, so a lost rank is healed by starting a new child).
    entry: `python -m kimi_mlx.cluster.tensor.relay` (`tensor.relay.relay_main`), spawned
    by `tensor.relay.Rank0Process` from `tensor.launch.form_group`
    modules: `tensor.relay`, `tensor.rank` (loading the slices), `tensor.step`,
    `tensor.wire`, `tensor.prompt_cache`, `tensor.rows`.

One-shot launch -- the Mac that runs the command; with `--parallel tensor` this process is
rank 0 itself (no child).
    entry: `kimi-mlx cluster launch` -> `cli.run` -> `launch.run`
    modules: `launch`, `head.launch` and the pipeline head's modules, or `tensor.launch`,
    `tensor.group`, `tensor.step`, `tensor.prefill`.

Pipeline stage (the node daemon) -- every node Mac, one per Mac.
    entry: `kimi-mlx cluster serve` -> `cli.run` -> `node.daemon.serve`
    modules: `node.daemon`, `node.server`, `node.service`, `node.loading`, `node.forward`,
    `node.runner`, `node.sessions`, `node.compute`, `node.stage_cache`, `node.capture`,
    `node.rank` (hosting a tensor rank), `net.discovery` (advertising), `net.auth`.

Tensor node rank -- a child of a node daemon, one per group it joins.
    entry: `python -m kimi_mlx.cluster.tensor.rank` (`tensor.rank.rank_main`), spawned by
    `node.rank` on the head's `StartRank`
    modules: `tensor.rank`, `tensor.step`, `tensor.wire`, `tensor.prompt_cache`.

Discovery -- no process of its own: a zeroconf advertisement in each node daemon
(`net.discovery.Advertiser`, started by `node.server`) and a browse
(`net.discovery.browse`) in the heads (`net.nodes`) and in `kimi-mlx cluster ls`
(`admin.ls`).

`net` (stage.proto and its stubs, auth, channels, the wire, fingerprints) is shared by every
role and imports nothing else of the cluster; `head`, `tensor` and `node` share only `net`
(the import-linter contracts in pyproject.toml, checked by tests/test_architecture.py).
`bench` holds the cluster benchmarks of `make bench`.
"""
