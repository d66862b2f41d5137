"""What DeepEP's intranode buffer does on the GPUs of this host, checked against plain torch.

    python probe_deepep.py import              # version, the extension loads, sm_90 compiled
    python probe_deepep.py one-rank            # a world-size-1 NCCL group: buffer, layout, dispatch, combine
    python probe_deepep.py ranks-on-one-gpu N  # N processes (2, 4 or 8) on cuda:0, a gloo group, dispatch+combine
    python probe_deepep.py megatron-flex N     # the same through Megatron's MoEFlexTokenDispatcher (deepep backend)
    python probe_deepep.py ranks-on-gpus N     # rank r on cuda:r, an NCCL group (the multi-GPU check)
    python probe_deepep.py megatron-flex-on-gpus N

Each mode prints one JSON line per step (`{"step": ..., "ok": ..., ...}`) and exits 0 when every step it
expected to work did work (a step that is expected to be refused counts as working when it is refused with
the expected message). The N-ranks-on-one-GPU mode runs the real intranode kernels for N ranks: the buffer
only uses its process group to exchange device ids and CUDA IPC handles (gloo does), and IPC handles open
in another process on the same device; the ranks' kernels then time-share one GPU, which tests the numbers,
not the speed or NVLink.

Reference for tokens x [T, H] (bf16) and top-k expert ids [T, K] over E experts split evenly over the ranks:
a token goes to rank r when one of its experts lives on r; dispatch delivers to rank r every such token of
every rank, with its expert ids made local (-1 for experts of other ranks); combine sends each received row
back and sums the copies, so with unchanged rows the result is x[t] times the number of ranks token t went to.
"""

import json
import os
import sys
import tempfile

import torch

T, H, E, K = 96, 512, 16, 4  # tokens per rank, hidden, experts, top-k (tiny: a correctness probe)
DEVICE = "cuda"


def say(step, ok, **kw):
    print(json.dumps({"step": step, "ok": bool(ok), **kw}), flush=True)
    return bool(ok)


def inputs(rank, world, device):
    """The same tokens and routes on every process (a seed per source rank), so each rank can build the
    reference of what it should receive. Column 0 holds the source rank and column 1 the token index
    (exact in bf16 below 256), so a received row names its source."""
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=g)
    idx = scores.topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=g) < 0.1] = -1  # some empty slots, as a capacity drop leaves them
    return x.to(device), idx.to(device=device, dtype=torch.int64)


def layout_reference(idx, world):
    per_rank = E // world
    valid = idx >= 0
    owner = torch.where(valid, idx // per_rank, torch.full_like(idx, -1))
    in_rank = torch.stack([(owner == r).any(dim=1) for r in range(world)], dim=1)  # [T, world]
    per_expert = torch.bincount(idx[valid], minlength=E)
    return in_rank.sum(0).int(), per_expert.int(), in_rank


def excess(got, ref, rel):
    """(the largest |got - ref| over rel * |ref| + 1e-6, and 1): <= 1 passes. Elementwise, so the small
    entries of a row are held as tightly as its large ones (columns 0 and 1 hold indices up to T)."""
    return ((got - ref).abs() / (rel * ref.abs() + 1e-6)).max().item(), 1.0


def buffer_for(group, world, deep_ep, **kw):
    hidden_bytes = H * 2
    if world in (2, 4, 8):
        cfgs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    else:
        cfgs = (deep_ep.Config(deep_ep.Buffer.num_sms, 6, 256, 6, 128),)
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in cfgs)
    return deep_ep.Buffer(group, nvl, 0, **kw)


def check_layout(buf, idx, world, rank):
    ref_rank, ref_expert, ref_in = layout_reference(idx.cpu(), world)
    n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    ok = (torch.equal(n_rank.cpu(), ref_rank) and n_rdma is None and torch.equal(n_expert.cpu(), ref_expert)
          and torch.equal(in_rank.cpu(), ref_in))
    say("layout", ok, rank=rank, tokens_per_rank=n_rank.tolist(), reference=ref_rank.tolist())
    return ok, (n_rank, n_expert, in_rank)


def check_dispatch_combine(buf, x, idx, layout, world, rank, deep_ep, config=None):
    n_rank, n_expert, in_rank = layout
    w = torch.rand(idx.shape, device=x.device)
    recv_x, recv_idx, recv_w, per_local_expert, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=idx, topk_weights=w, config=config)
    # reference: every token of every source rank that has an expert on this rank, in (source, token) order
    per_rank = E // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    ref_rows, ref_idx = [], []
    for src in range(world):
        sx, sidx = inputs(src, world, "cpu")
        for t in range(T):
            mine = (sidx[t] >= lo) & (sidx[t] < hi)
            if mine.any():
                ref_rows.append(sx[t])
                ref_idx.append(torch.where(mine, sidx[t] - lo, torch.full_like(sidx[t], -1)))
    got = recv_x.cpu()
    order = (got[:, 0].float() * 1000 + got[:, 1].float()).argsort()  # the same rows in (source, token) order
    ref = torch.stack(ref_rows) if ref_rows else torch.empty(0, H, dtype=torch.bfloat16)
    rows_ok = got.shape == ref.shape and torch.equal(got[order], ref)
    idx_ok = rows_ok and torch.equal(recv_idx.cpu()[order], torch.stack(ref_idx))
    counts = torch.bincount(torch.stack(ref_idx)[torch.stack(ref_idx) >= 0], minlength=per_rank).tolist()
    say("dispatch", rows_ok and idx_ok and per_local_expert == counts, rank=rank, received=int(got.shape[0]),
        expected=int(ref.shape[0]), rows_exact=rows_ok, local_ids_exact=idx_ok,
        tokens_per_local_expert=per_local_expert, reference_counts=counts)
    combined, _, _ = buf.combine(recv_x, handle)
    copies = in_rank.sum(1, keepdim=True).to(torch.float32)  # [T, 1] ranks each token went to
    ref_c = (x.float() * copies)
    err, tol = excess(combined.float(), ref_c, 1e-2)  # sums of identical bf16 copies: one rounding
    return say("combine", err <= tol, rank=rank, max_error_over_tolerance=err)


def mode_import():
    import importlib.metadata as md
    import deep_ep
    import deep_ep_cpp
    say("import", True, version=md.version("deep_ep"), torch=torch.__version__, extension=deep_ep_cpp.__file__,
        sm90_compiled=deep_ep.Buffer.is_sm90_compiled(), device=torch.cuda.get_device_name(0),
        capability=list(torch.cuda.get_device_capability(0)), gpus=torch.cuda.device_count())
    return 0


def mode_one_rank():
    import torch.distributed as dist
    import deep_ep
    torch.cuda.set_device(0)
    store = tempfile.mktemp(prefix="deepep-store-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    ok = True
    try:
        # explicitly destroyed: the destructor's barrier kernel exists for 2, 4 and 8 ranks only, so at one
        # rank an implicit destroy at exit throws from a destructor and aborts the process (seen on an H200)
        buf = buffer_for(dist.group.WORLD, 1, deep_ep, explicitly_destroy=True)
        ok &= say("buffer", buf.runtime.is_available(), world=1, nvl_bytes=buf.num_nvl_bytes)
        x, idx = inputs(0, 1, DEVICE)
        lay_ok, layout = check_layout(buf, idx, 1, 0)
        ok &= lay_ok
        # DeepEP's intranode kernels are instantiated for 2, 4 and 8 ranks only: both refusals are expected
        for name, cfg, want in (("dispatch-default-config", None, "Unsupported number of EP ranks: 1"),
                                ("dispatch-explicit-config", deep_ep.Config(deep_ep.Buffer.num_sms, 6, 256, 6, 128),
                                 "Unsupported ranks")):
            try:
                check_dispatch_combine(buf, x, idx, layout, 1, 0, deep_ep, config=cfg)
                ok &= say(name, False, note="ran at one rank; expected a refusal")
            except (AssertionError, RuntimeError) as e:
                ok &= say(name, want in str(e), refused=f"{type(e).__name__}: {str(e)[:300]}", expected=want)
            torch.cuda.synchronize()
        try:
            buf.destroy()
            ok &= say("destroy", False, note="destroyed at one rank; expected a refusal")
        except RuntimeError as e:
            ok &= say("destroy", "Unsupported ranks" in str(e), refused=str(e)[:300], expected="Unsupported ranks")
    except Exception as e:  # reported, and turned into a failing exit
        ok = say("error", False, rank=0, error=f"{type(e).__name__}: {str(e)[:400]}")
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


def _start(rank, world, store, spread):
    """This rank's GPU and process group: all on cuda:0 over gloo, or rank r on cuda:r over NCCL (``spread``)."""
    import torch.distributed as dist
    torch.cuda.set_device(rank if spread else 0)
    dist.init_process_group("nccl" if spread else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)


def _rank_main(rank, world, store, results, spread=False):
    import torch.distributed as dist
    import deep_ep
    _start(rank, world, store, spread)
    ok = True
    try:
        buf = buffer_for(dist.group.WORLD, world, deep_ep)
        ok &= say("buffer", buf.runtime.is_available(), rank=rank, world=world, nvl_bytes=buf.num_nvl_bytes)
        x, idx = inputs(rank, world, DEVICE)
        lay_ok, layout = check_layout(buf, idx, world, rank)
        ok &= lay_ok
        ok &= check_dispatch_combine(buf, x, idx, layout, world, rank, deep_ep)
        torch.cuda.synchronize()
        dist.barrier()
    except Exception as e:  # reported per rank and turned into a failing exit below
        ok = say("error", False, rank=rank, error=f"{type(e).__name__}: {str(e)[:400]}")
    finally:
        dist.destroy_process_group()
    results[rank] = ok


def spawn(name, main, world, spread):
    import torch.multiprocessing as mp
    if spread and torch.cuda.device_count() < world:
        say(name, False, ranks=world, gpus=torch.cuda.device_count(), note="fewer GPUs than ranks")
        return 1
    store = tempfile.mktemp(prefix="deepep-store-")
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(main, args=(world, store, results, spread), nprocs=world, join=True)
        ok = len(results) == world and all(results.values())
    say(name, ok, ranks=world)
    return 0 if ok else 1


def _megatron_main(rank, world, store, results, spread=False):
    """Megatron's flex dispatcher (deepep backend) at EP = world, every rank on cuda:0, process groups over
    gloo (DeepEP's buffer only exchanges handles through its group), with the plugin's patch applied. Each local expert e scales its rows by
    (e + 1) and by the routing probability, as Megatron's experts apply it; the reference is the sum over a
    token's selected experts of (e + 1) * p * x, computed in fp32 from the same inputs."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    _start(rank, world, store, spread)
    ok = False
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        per_rank = E // world
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                                   moe_router_topk=K, moe_token_dispatcher_type="flex",
                                   moe_flex_dispatcher_backend="deepep", expert_model_parallel_size=world,
                                   moe_router_dtype="fp32", bf16=True, params_dtype=torch.bfloat16,
                                   use_cpu_initialization=True)
        local = [rank * per_rank + i for i in range(per_rank)]
        # the deepep plugin's patch-lane entry, as a run applies it: Megatron's buffer sizing asks DeepEP for
        # an RDMA size that a build without NVSHMEM refuses
        from nam_plugin_deepep import patch
        needed = patch.detect()
        patch.apply()
        say("patch", not patch.detect(), rank=rank, name=patch.NAME, needed=needed)
        d = MoEFlexTokenDispatcher(per_rank, local, config,
                                   pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        x, _ = inputs(rank, world, DEVICE)
        # K distinct experts per token with probabilities in (0, 1), as Megatron's router hands them over
        idx = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(77 + rank + t))[:K]
                           for t in range(T)]).to(DEVICE)
        probs = torch.zeros(T, E, device=DEVICE)
        probs.scatter_(1, idx, torch.rand(T, K, generator=torch.Generator().manual_seed(5 + rank)).to(DEVICE))
        routing = probs > 0
        h, p = d.dispatch_preprocess(x.view(T, 1, H), routing, probs)
        h, p = d.token_dispatch(h, p)
        tokens, per_expert, pprobs = d.dispatch_postprocess(h, p)
        counts = per_expert.tolist() if torch.is_tensor(per_expert) else list(per_expert)
        scale = torch.cat([torch.full((int(n),), float(e + 1), device=DEVICE) for e, n in zip(local, counts)])
        out = (tokens.float() * (scale * pprobs.float())[:, None]).to(torch.bfloat16)
        out = d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))
        ref = (x.float() * (probs * torch.arange(1, E + 1, device=DEVICE)).sum(1, keepdim=True)).view(T, 1, H)
        # every term of a token's sum has x[t]'s sign, so K + 1 bf16 roundings stay within 2% of |ref|
        err, tol = excess(out.float(), ref, 2e-2)
        ok = say("megatron-flex", err <= tol, rank=rank, world=world, rows_received=int(tokens.shape[0]),
                 tokens_per_local_expert=[int(n) for n in counts], max_error_over_tolerance=err)
        torch.cuda.synchronize()
        dist.barrier()
    except Exception as e:  # reported per rank and turned into a failing exit below
        import traceback
        ok = say("error", False, rank=rank, error=f"{type(e).__name__}: {str(e)[:400]}",
                 where=traceback.format_exc()[-1200:])
    finally:
        dist.destroy_process_group()
    results[rank] = ok


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "import":
        sys.exit(mode_import())
    if mode == "one-rank":
        sys.exit(mode_one_rank())
    spawned = {"ranks-on-one-gpu": (_rank_main, False), "ranks-on-gpus": (_rank_main, True),
               "megatron-flex": (_megatron_main, False), "megatron-flex-on-gpus": (_megatron_main, True)}
    if mode in spawned:
        main, spread = spawned[mode]
        sys.exit(spawn(f"{mode}-{sys.argv[2]}", main, int(sys.argv[2]), spread))
    sys.exit(f"unknown mode {mode!r}; expected import | one-rank | {' N | '.join(spawned)} N")
