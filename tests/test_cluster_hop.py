"""The hop bench's null stages (kimi_mlx.cluster.bench.hop): a middle null stage hands on
its input unchanged in the wire layout, and three null stage processes behind the real
service and transport echo every token they are sent (values asserted; no timing)."""

import mlx.core as mx
import numpy as np

from kimi_mlx.cluster.head.pipeline import Pipeline

from kimi_mlx.cluster.net.nodes import check_nodes
from kimi_mlx.cluster.bench.hop import NullCluster, NullRunner
from kimi_mlx.sampling import Sampling
from kimi_mlx.cluster.node.runner import StageSpec
from kimi_mlx.testing.cluster import reference_checkpoint
from kimi_mlx.cluster.head.transport import GrpcTransport
from kimi_mlx.model.config import ModelArgs, read_config


def test_middle_null_stage_passes_banks_and_state_on(tmp_path):
    args = ModelArgs.from_config(read_config(reference_checkpoint(tmp_path)))
    L, bs = args.num_hidden_layers, args.attn_res_block_size
    # a middle range that crosses an AttnRes block boundary: it adds banks
    start, end = 1, min(L - 1, bs + 1)
    r = NullRunner(args, StageSpec("fp", start, end, 1, 3, "float32", "float32"))
    k_in, k_out = -(-start // bs), -(-end // bs)
    assert k_out > k_in
    x = np.random.default_rng(0).standard_normal((k_in + 1, 1, 5, args.hidden_size)).astype(np.float32)
    s = r.new_session("s", "h", Sampling())
    out = np.array(r.run(s, 0, 0, mx.array(x), sample=False).hidden)
    assert out.shape == (k_out + 1, 1, 5, args.hidden_size)
    np.testing.assert_array_equal(out[:k_in], x[:k_in])  # banks already taken
    np.testing.assert_array_equal(out[-1], x[-1])  # the partial sum
    for k in range(k_in, k_out):  # identity layers: each new bank is the partial sum
        np.testing.assert_array_equal(out[k], x[-1])
    assert (s.next_seq, s.offset) == (1, 5)


def test_three_null_stages_echo_tokens_through_the_real_transport(tmp_path):
    ckpt = reference_checkpoint(tmp_path)
    cluster = NullCluster(tmp_path, ckpt, [0.0, 0.0, 0.0])
    t = GrpcTransport(cluster.secret, peer_timeout=30)
    try:
        accepted, rejected = check_nodes(cluster.nodes(), t.stub_for, cluster.fp)
        assert not rejected and len(accepted) == 3
        t.load(cluster.fp, cluster.plan(range(3)), "float32", "float32")
        vocab = cluster.args.vocab_size
        pipe = Pipeline(t, prefill_chunk=4)
        for last in (1, 257, vocab - 1):  # ids float32 holds exactly, > bf16's 256
            prompt = [5, 6, 7, 8, 9, 10, last]  # two prefill chunks, then the sampled one
            got = [tok for tok, _ in pipe.generate(prompt, Sampling(), 3)]
            assert got == [last] * 3
    finally:
        t.shutdown()
        cluster.stop()
