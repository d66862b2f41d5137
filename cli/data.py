"""``nam data prepare`` and ``nam data inspect``: build a prepared dataset folder, and look inside one."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from nam_cli.console import out, print_json
from nam_cli.options import JsonOpt

app = typer.Typer(
    name="data",
    help="Prepare training data (Megatron indexed format) and inspect prepared datasets.",
    no_args_is_help=True,
)


@app.command("prepare")
def prepare_command(
    src: Annotated[Path, typer.Argument(help="A folder of text/code files, a .jsonl file, or .parquet files (a "
                                        "'text' column, or token ids in 'tokens'/'input_ids'; needs pyarrow).")],
    out_dir: Annotated[Path, typer.Option("--out", help="The dataset folder to write (created atomically).")],
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", help="'byte' (built in) or the path of a Hugging Face tokenizer.json.")
    ] = "byte",
    eod_token: Annotated[
        Optional[str],
        typer.Option("--eod-token", help="End-of-document token of a tokenizer.json that has no usual one."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace --out if it exists and is not empty.")
    ] = False,
    no_structure: Annotated[
        bool, typer.Option("--no-structure", help="Do not write the per-token code-structure ids.")
    ] = False,
    val_fraction: Annotated[
        float, typer.Option("--val-fraction", help="Hold out this share of the documents, spread through them, "
                            "for validation (train.eval_every); e.g. 0.01. At least one document when above 0.")
    ] = 0.0,
    json_out: JsonOpt = False,
) -> None:
    """Tokenize SRC into DIR: tokens.bin/.idx, structure.bin/.idx and a dataset.json manifest."""
    from nam_core.data.prepare import prepare
    from nam_core.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer, eod_token=eod_token)
    annotate = None
    if not no_structure:
        from nam56r.blocks.structure import char_structure_ids

        annotate = char_structure_ids
    with _sigterm_as_exit():
        summary = prepare(src, out_dir, tok, annotate=annotate, overwrite=overwrite, progress=not json_out,
                          val_fraction=val_fraction)
    if json_out:
        print_json(summary.to_dict())
        return
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(summary.skipped.items())) or "none"
    out.print(f"prepared {summary.out} in {summary.seconds:.1f} s")
    out.print(f"  source     {summary.source_kind}: {summary.files_read} file(s) read, skipped: {skipped}")
    held = (f", {summary.validation_documents:,} held out for validation"
            if summary.validation_documents else "")
    out.print(f"  documents  {summary.documents:,}{held}")
    out.print(f"  tokens     {summary.tokens:,} (tokenizer {tok.name}, vocab {tok.vocab_size}, "
              f"max id {summary.max_token_id})")
    out.print(f"  structure  {'yes' if summary.structure else 'no'} ({summary.structure_note})")
    out.print(f"  checksums  sha256 of every file in dataset.json (`nam data inspect {summary.out} --verify`)")


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM (``kill``, a scheduler's stop) as an exit of 143 through Python while preparing, so the
    half-written ``<out>.tmp-<pid>`` is removed on the way out, as on Ctrl-C; SIGKILL leaves it to the next
    prepare. The previous handler comes back afterwards."""
    import signal
    import threading

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sample(dataset, count: int) -> dict:
    """The first ``count`` tokens of the first document, as ids and decoded text."""
    from nam_core.data.tokenizer import tokenizer_from_description
    from nam_core.errors import DataError

    ids = [int(i) for i in dataset.document(0)[:count]] if dataset.documents and count > 0 else []
    try:
        text = tokenizer_from_description(dataset.tokenizer).decode(ids)
    except DataError as e:  # the tokenizer.json moved: the ids are still worth showing
        text, note = None, e.message
    else:
        note = None
    return {"ids": ids, "text": text, "note": note}


@app.command("inspect")
def inspect_command(
    path: Annotated[Path, typer.Argument(help="A dataset folder written by `nam data prepare`.")],
    sample: Annotated[int, typer.Option("--sample", help="Decode this many tokens of the first document.")] = 64,
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every .bin against its sha256 in dataset.json, "
                      "even when it is unchanged since its last check (which training trusts).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Check a prepared dataset against its manifest and show its size, vocabulary and a decoded sample."""
    from nam_core.data.dataset import open_dataset

    dataset = open_dataset(path, verify_all=verify, progress=True if verify else None)
    m = dataset.manifest
    info = {
        "path": str(dataset.path),
        "documents": dataset.documents,
        "validation_documents": dataset.validation_documents,
        "tokens": dataset.num_tokens,
        "tokenizer": dataset.tokenizer,
        "vocab_size": dataset.tokenizer.get("vocab_size"),
        "max_token_id": dataset.max_token_id,
        "structure": m["structure"],
        "source": m.get("source"),
        "files_skipped": m.get("files_skipped"),
        "checksums": {name: {"sha256": c["sha256"], "ok": True, "hashed": c["hashed"], "seconds": c["seconds"]}
                      for name, c in dataset.integrity.items()},
        "sample": _sample(dataset, sample),
    }
    if json_out:
        print_json(info)
        return
    tok = dataset.tokenizer
    out.print(f"dataset    {info['path']}")
    out.print(f"documents  {info['documents']:,}" + (f", {info['validation_documents']:,} held out for "
              "validation" if info["validation_documents"] else ""))
    out.print(f"tokens     {info['tokens']:,}")
    out.print(f"vocab      {tok.get('name')} ({tok.get('vocab_size')} ids, eod {tok.get('eod')}), "
              f"max id {info['max_token_id']}")
    present = m["structure"].get("present")
    out.print(f"structure  {'yes' if present else 'no'} ({m['structure'].get('note', '')})")
    for name, c in info["checksums"].items():
        how = (f"hashed in {c['seconds']:.1f} s" if c["hashed"]
               else "unchanged since it was last hashed; --verify re-hashes it")
        out.print(f"checksum   {name} ok: sha256 {c['sha256'][:16]}... ({how})")
    s = info["sample"]
    out.print(f"sample     first {len(s['ids'])} tokens of document 0:")
    if s["text"] is not None:
        out.print(s["text"], markup=False, highlight=False)
    else:
        out.print(f"{s['ids']}\n({s['note']})", markup=False, highlight=False)


@app.command("checksum")
def checksum_command(
    path: Annotated[Path, typer.Argument(help="A dataset folder prepared by an older nam (no .bin checksums).")],
    json_out: JsonOpt = False,
) -> None:
    """Record the sha256 of each .bin in an older dataset.json, trusting the files as they are now."""
    from nam_core.data.dataset import add_checksums

    added = add_checksums(path)
    if json_out:
        print_json({"path": str(path), "sha256": added})
        return
    for name, digest in added.items():
        out.print(f"recorded   {name}: sha256 {digest[:16]}...")
    out.print(f"{path} opens with its checksums now; `nam data inspect {path} --verify` re-checks them")
