"""N-gram hash embedding: hashing against Python ints, document boundaries, zero start, meta build."""

import torch

from nam56r.blocks.ngram_hash import NgramHashEmbedding, is_prime, primes_from
from nam56r.config import NAM56RConfig

CFG = NAM56RConfig(hidden=8, ngram_table=1000)  # orders (2, 3), 8 heads, dim 16: 16 tables of ~1000 rows


def naive_buckets(emb: NgramHashEmbedding, ids: list[int], doc_start: list[int]) -> list[list[int]]:
    """h_j(t) with Python ints; ids before the token's document start read as the pad id 0."""
    mult, xor = emb.hash_mult.tolist(), emb.hash_xor.tolist()
    out = []
    for t in range(len(ids)):
        row = []
        for j, order in enumerate(emb.table_orders):
            mix = 0
            for k in range(order):
                prev = ids[t - k] if t - k >= doc_start[t] else 0
                mix ^= prev * mult[j][k]
            row.append((mix ^ xor[j]) % emb.primes[j])
        out.append(row)
    return out


def test_primes_are_distinct_primes_at_or_above_the_table_size():
    ps = primes_from(1000, 16)
    assert ps[:3] == [1009, 1013, 1019] and len(set(ps)) == 16 and all(map(is_prime, ps))
    assert [n for n in range(30) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]


def test_hash_equals_python_int_computation():
    emb = NgramHashEmbedding(CFG)
    torch.manual_seed(0)
    ids = torch.randint(0, 131072, (2, 9))
    got = emb.buckets(ids)
    for b in range(2):
        assert got[b].tolist() == naive_buckets(emb, ids[b].tolist(), [0] * 9)
    assert (emb.hash_mult % 2 == 1).all()


def test_segments_stop_ngrams_at_document_boundaries():
    emb = NgramHashEmbedding(CFG)
    doc_a, doc_b = [5, 6, 7, 8], [11, 12, 13, 14, 15]
    ids = torch.tensor([doc_a + doc_b])
    seg = torch.tensor([[0] * 4 + [1] * 5])
    packed = emb.buckets(ids, seg)
    alone = emb.buckets(torch.tensor([doc_b]))
    assert torch.equal(packed[0, 4:], alone[0])  # doc B hashes as if it started the row
    assert packed[0].tolist() == naive_buckets(emb, doc_a + doc_b, [0] * 4 + [4] * 5)
    assert not torch.equal(emb.buckets(ids)[0, 4:], alone[0])  # without segments the 2/3-grams cross over


def test_zero_output_at_init_and_table_gets_gradient_once_out_proj_moves():
    emb = NgramHashEmbedding(CFG)
    ids = torch.randint(0, 500, (2, 6))
    out = emb(ids)
    assert out.shape == (2, 6, CFG.hidden) and torch.count_nonzero(out) == 0
    out.sum().backward()
    assert emb.out_proj.weight.grad.abs().sum() > 0 and emb.table.weight.grad.abs().sum() == 0

    torch.nn.init.normal_(emb.out_proj.weight)
    emb.zero_grad()
    emb(ids).sum().backward()
    touched = emb.table.weight.grad.abs().sum(-1) > 0
    rows = (emb.buckets(ids) + emb.table_start).unique()
    assert torch.equal(touched.nonzero().squeeze(1), rows)  # exactly the hashed rows


def test_meta_build_then_to_empty_and_reset_reproduces_the_constants():
    with torch.device("meta"):
        meta = NgramHashEmbedding(CFG)
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    cpu = NgramHashEmbedding(CFG)
    for name, buf in cpu.named_buffers():
        assert torch.equal(buf, meta.get_buffer(name)), name
    assert {"hash_mult", "hash_xor"} <= set(cpu.state_dict())  # the constants travel with checkpoints
    assert "table_prime" not in cpu.state_dict()  # derived from the config


def test_nam56r_size_builds_on_meta():
    with torch.device("meta"):
        emb = NgramHashEmbedding(NAM56RConfig())
    assert emb.primes[0] == 500_009 and len(set(emb.primes)) == 16  # smallest prime >= 500_000
    n_rows = sum(emb.primes)  # ~8.0M
    assert sum(p.numel() for p in emb.parameters()) == n_rows * 16 + 16 * 16 * 4096  # table + out_proj
