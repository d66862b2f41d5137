"""nam56r/flops.py against independent counts.

* Real blocks: ``torch.utils.flop_counter.FlopCounterMode`` counts every matmul (mm, bmm, addmm) of one forward
  of the block on a tiny config. The reference backends compute the whole ``s x s`` score matrix (masked
  afterwards), every top-k slot (live or not) and every expert (gated afterwards), so the expectation is the
  same formula evaluated at the keys and experts the reference *executes*; that makes each comparison exact
  (tolerance 0: all sizes are small integers, the sums exact in float64). Known excluded term: the Mamba-3
  MIMO rank contraction ``sum_r o * mimo_o``, which the reference runs as an einsum (``2 H R P`` per token) and
  the formula leaves out as elementwise.
* Plain ``nn.Linear`` stacks for the parts with no block here yet (MTP) and the output head.
* The full 52-layer config: per-kind totals follow the layer plan; training = 3 x forward; hand numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import nam56r.blocks.ngram_hash as ngram
import nam56r.reference.mamba3 as ref
import nam56r.state as state_mod
from nam56r import flops as F
from nam56r.blocks import dsa, indexer, mamba3, mla, moe
from nam56r.config import NAM56RConfig
from nam56r.pattern import resolve
from nam56r.reference import attention

B, S = 2, 24
TINY = NAM56RConfig(
    hidden=32, vocab_size=97, seq_len=S,
    attn_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=16,
    index_heads=2, index_head_dim=8, index_topk=8,  # top-k 8 of 24: the sparse path is exercised
    d_state=16, mamba_headdim=8, mamba_ngroups=2, mamba_mimo_rank=2, mamba_chunk=8,  # 8 heads in 2 groups
    num_experts=4, moe_topk=2, moe_ffn_hidden=16, moe_shared_ffn_hidden=32, mtp_ffn_hidden=32,
    ngram_orders=(2, 3), ngram_heads=2, ngram_table=50, ngram_dim=4,
)


def counted(fn) -> int:
    """Matmul FLOPs of one call of ``fn`` as FlopCounterMode sees them (2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# --- (a) real blocks ------------------------------------------------------------------------------
@pytest.mark.parametrize("s", [24, 20])  # 20: not a multiple of the chunk (8), the scan pads to 24
def test_mamba3_block_matches_formula(s):
    block = mamba3.Mamba3Mixer(TINY, ref.ReferenceSSMScan())
    x = torch.randn(B, s, TINY.hidden)
    mimo_contraction = 2 * TINY.mamba_heads * TINY.mamba_mimo_rank * TINY.mamba_headdim  # excluded, see top
    expected = B * s * (F.mamba3_forward_flops(TINY, s) + mimo_contraction)
    assert counted(lambda: block(x)) == expected


def test_mamba3_projections_match_a_linear_stack():
    """in_proj + out_proj as bare Linears of the section 1.1 widths, independent of the block."""
    c = TINY
    angles = int(c.d_state * c.mamba_rope_fraction) // 2  # N 16, rope 0.5: 8 rotated dims, 4 angles
    in_width = 2 * c.d_inner + 2 * c.d_state * c.mamba_ngroups * c.mamba_mimo_rank + 3 * c.mamba_heads + angles
    stack = nn.Sequential(nn.Linear(c.hidden, in_width, bias=False))
    out = nn.Linear(c.d_inner, c.hidden, bias=False)
    x, y = torch.randn(B * S, c.hidden), torch.randn(B * S, c.d_inner)
    assert counted(lambda: (stack(x), out(y))) == B * S * F.mamba3_projection_flops(c)


def test_mla_block_matches_formula():
    block = mla.MLA(TINY, attention.ReferenceAttention())
    x = torch.randn(B, S, TINY.hidden)
    # The reference forms all S x S scores, so it executes S keys per query; the model formula uses (S+1)/2.
    expected = B * S * (F.mla_projection_flops(TINY) + F.mla_attention_flops(TINY, keys=S))
    assert counted(lambda: block(x)) == expected
    model = F.mla_projection_flops(TINY) + F.mla_attention_flops(TINY, F.causal_keys(S))
    assert F.mla_forward_flops(TINY, S) == model


@pytest.mark.parametrize("warmup", [False, True])
def test_dsa_block_matches_formula(warmup):
    cfg = TINY.replace(dsa_dense_warmup=warmup)
    block = dsa.DSA(cfg, attention.ReferenceAttention(), indexer.FullIndexer(), dsa_rank=0)
    x = torch.randn(B, S, cfg.hidden)
    # Executed keys: the indexer scores all S; attention and teacher run over all S (warm-up) or all top-k slots.
    keys = S if warmup else min(cfg.index_topk, S)
    expected = B * S * (
        F.mla_projection_flops(cfg)
        + F.indexer_projection_flops(cfg)
        + F.indexer_score_flops(cfg, keys=S)
        + F.mla_attention_flops(cfg, keys)
        + F.indexer_teacher_flops(cfg, keys)
    )
    assert counted(lambda: block(x, state_mod.ForwardState())) == expected


def test_moe_block_matches_formula():
    from nam56r.reference.moe import ReferenceExperts

    block = moe.MoE(TINY, ReferenceExperts())
    x = torch.randn(B, S, TINY.hidden)
    # The reference MoE runs all E experts and gates; the same formula with top-k = E is what it executes.
    executed = F.moe_forward_flops(TINY.replace(moe_topk=TINY.num_experts))
    assert counted(lambda: block(x)) == B * S * executed
    routed = 6 * TINY.hidden * TINY.moe_ffn_hidden
    assert executed - F.moe_forward_flops(TINY) == (TINY.num_experts - TINY.moe_topk) * routed


def test_ngram_block_matches_formula():
    block = ngram.NgramHashEmbedding(TINY)
    ids = torch.randint(0, TINY.vocab_size, (B, S))
    assert counted(lambda: block(ids)) == B * S * F.ngram_forward_flops(TINY)


def test_mtp_and_head_match_a_linear_stack():
    """One MTP depth minus its MLA (counted against the block above) and the output head, as bare Linears."""
    c = TINY
    eh_proj = nn.Linear(2 * c.hidden, c.hidden, bias=False)
    gate, up = nn.Linear(c.hidden, c.mtp_ffn_hidden, bias=False), nn.Linear(c.hidden, c.mtp_ffn_hidden, bias=False)
    down = nn.Linear(c.mtp_ffn_hidden, c.hidden, bias=False)
    head = nn.Linear(c.hidden, c.vocab_size, bias=False)
    t = B * S

    def mtp():
        h = eh_proj(torch.randn(t, 2 * c.hidden))
        down(torch.nn.functional.silu(gate(h)) * up(h))

    assert counted(mtp) == t * (F.mtp_depth_forward_flops(c, S) - F.mla_forward_flops(c, S))
    assert counted(lambda: head(torch.randn(t, c.hidden))) == t * F.ce_forward_flops(c)


# --- (b) the full config follows the layer plan ---------------------------------------------------
FULL = NAM56RConfig()


def test_full_config_counts_follow_the_plan():
    plan = resolve(FULL.pattern, FULL.num_layers, FULL.mla_attention_ranks)
    assert plan.counts() == {"mla": 4, "dsa": 9, "mamba": 17, "moe": 22}  # NAM56R: 52 layers
    s = FULL.seq_len
    fwd = F.flops_per_token(FULL, training=False)
    assert fwd.seq_len == 4096
    assert fwd.by_block["mamba"] == 17 * F.mamba3_forward_flops(FULL, s)
    assert fwd.by_block["moe"] == 22 * F.moe_forward_flops(FULL)
    assert fwd.by_block["mla"] == 4 * F.mla_forward_flops(FULL, s)
    assert fwd.by_block["dsa"] == 9 * F.dsa_forward_flops(FULL, s)
    assert fwd.by_block["mtp"] == 2 * F.mtp_depth_forward_flops(FULL, s)
    assert fwd.by_block["ce"] == 3 * F.ce_forward_flops(FULL)  # main head + 2 MTP heads
    assert fwd.by_block["embedding"] == (F.ngram_forward_flops(FULL) if plan.ngram_head else 0.0)
    assert set(fwd.by_block) == set(F.BLOCKS)
    assert fwd.total == sum(fwd.by_block.values())
    assert fwd.to_dict()["by_block"] == fwd.by_block


def test_dense_warmup_only_changes_dsa():
    sparse = F.flops_per_token(FULL, dense_warmup=False)
    dense = F.flops_per_token(FULL, dense_warmup=True)
    for block in F.BLOCKS:
        if block != "dsa":
            assert dense.by_block[block] == sparse.by_block[block]
    # Warm-up: attention and teacher over (s+1)/2 = 2048.5 keys instead of 248.03 live top-k keys.
    n, key, value = FULL.attn_heads, FULL.kv_lora_rank + FULL.qk_rope_dim, FULL.kv_lora_rank  # 32, 128, 64
    per_key = 2 * n * key + 2 * n * value + 2 * n * key  # scores + p.V + teacher, per query-key pair
    keys_added = F.causal_keys(FULL.seq_len) - F.sparse_keys(FULL.seq_len, FULL.index_topk)  # 2048.5 - 248.03
    assert dense.by_block["dsa"] - sparse.by_block["dsa"] == pytest.approx(3 * 9 * per_key * keys_added, rel=1e-12)
    # The default follows the config field.
    assert F.flops_per_token(FULL.replace(dsa_dense_warmup=True)).total == dense.total


# --- (c) training = 3 x forward -------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [FULL, TINY], ids=["full", "tiny"])
def test_training_is_three_forwards(cfg):
    fwd = F.flops_per_token(cfg, training=False)
    train = F.flops_per_token(cfg, training=True)
    assert train.total == pytest.approx(3 * fwd.total, rel=1e-15)
    for block in F.BLOCKS:
        assert train.by_block[block] == 3 * fwd.by_block[block]


# --- (d) hand-computed numbers --------------------------------------------------------------------
def test_moe_by_hand():
    """hidden 8, 4 experts, top-2, routed width 3, shared width 5.

    router 2*8*4 = 64; routed 2 experts x 3 matrices x 2*8*3 = 288; shared 3 x 2*8*5 = 240; total 592.
    The two unchosen experts cost nothing: doubling the experts adds only router FLOPs (2*8*4 = 64).
    """
    cfg = NAM56RConfig(hidden=8, num_experts=4, moe_topk=2, moe_ffn_hidden=3, moe_shared_ffn_hidden=5)
    assert F.moe_forward_flops(cfg) == 592
    assert F.moe_forward_flops(cfg.replace(num_experts=8)) == 592 + 64


# Every width the hand numbers below use, pinned here so a change of a config.py default cannot move them.
PINNED = NAM56RConfig(
    hidden=4096, vocab_size=131072, attn_heads=32, q_lora_rank=64, kv_lora_rank=64, qk_nope_dim=64,
    qk_rope_dim=64, v_head_dim=128, d_state=128, mamba_expand=2, mamba_headdim=64, mamba_ngroups=8,
    mamba_mimo_rank=4, mamba_chunk=16, mamba_rope_fraction=0.5, num_experts=16, moe_topk=4,
    moe_ffn_hidden=160, moe_shared_ffn_hidden=576,
)


def test_full_width_blocks_by_hand():
    """Per-layer forward FLOPs per token at NAM56R's widths (``PINNED``) and s = 4096.

    MoE: router 2*4096*16 = 131,072; routed 4 * 6*4096*160 = 15,728,640; shared 6*4096*576 = 14,155,776.
    MLA projections: wq_a 524,288 + wq_b 524,288 + wkv_a 1,048,576 + absorb 262,144 + W_UV 524,288
    + wo 33,554,432 = 36,438,016; attention 2*32*(128 + 64) * 2048.5 = 25,171,968.
    Mamba-3: in_proj 2*4096*(16384 + 8192 + 384 + 32) = 204,734,464; out_proj 2*8192*4096 = 67,108,864;
    scan 128 * (2*16*16*(128 + 64) + 4*4*128*64) = 128 * 229,376 = 29,360,128.
    Head: 2*4096*131072 = 1,073,741,824.
    """
    s = 4096
    assert F.moe_forward_flops(PINNED) == 131_072 + 15_728_640 + 14_155_776
    assert F.mla_projection_flops(PINNED) == 36_438_016
    assert F.mla_forward_flops(PINNED, s) == 36_438_016 + 25_171_968
    assert F.mamba3_forward_flops(PINNED, s) == 204_734_464 + 67_108_864 + 29_360_128
    assert F.ce_forward_flops(PINNED) == 1_073_741_824
    assert F.sparse_keys(4096, 256) == (256 * 257 / 2 + 3840 * 256) / 4096 == 248.03125
    assert F.sparse_keys(100, 256) == F.causal_keys(100) == 50.5  # short rows: every past key is kept


def test_full_config_total_and_tflops(capsys):
    """Prints the full-config figure. NAM56R's published 289 TFLOP/s at ~9,250 tokens/s per GPU implies
    ~31.2 GFLOP/token by its own (unpublished) formula; nothing here is forced to agree with it."""
    report = F.flops_per_token(FULL)
    tflops = F.tflops_per_device(FULL, 9_250)
    assert tflops == pytest.approx(report.total * 9_250 / 1e12, rel=1e-15)
    with capsys.disabled():
        print(f"\nNAM56R training FLOPs/token at s={report.seq_len}: {report.total / 1e9:.3f} G "
              f"({tflops:.1f} TFLOP/s at 9,250 tokens/s)")
        for block, value in report.by_block.items():
            print(f"  {block:10s} {value / 1e9:8.4f} G  {100 * value / report.total:5.1f}%")


def test_rejects_a_non_positive_sequence():
    from nam_core.errors import ConfigError

    with pytest.raises(ConfigError, match="seq_len must be a positive"):
        F.flops_per_token(FULL, seq_len=0)
