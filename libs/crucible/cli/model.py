"""`crucible model info|import|export`: pretrained checkpoints in, trained weights out.

    crucible model info package:smollm2-135m-instruct          family, sizes, parameter count
    crucible model import ./Qwen3-0.6B --out ./ckpt            a Crucible checkpoint (+ tokenizer files)
    crucible model export --checkpoint ./ckpt --out ./hf       a Hugging Face directory
    crucible model export --run RUN --version 3 --out ./hf     a published weight version of a run

torch and transformers load only when a command runs.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

model_app = typer.Typer(help="Import pretrained checkpoints; export trained weights.", no_args_is_help=True)
SourceArg = Annotated[
    str, typer.Argument(help="A preset, a Hugging Face directory, a .gguf file or package:NAME.")
]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"crucible model: {message}", err=True)
    return typer.Exit(2)


@model_app.command("info")
def info(source: SourceArg, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Print a model's family, sizes and parameter count."""
    from crucible.model.hf import CheckpointError
    from crucible.model.sources import SourceError, model_config

    try:
        cfg = model_config(source)
    except (SourceError, CheckpointError, OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    summary = {
        "source": source,
        "family": cfg.family or "crucible",
        "layers": cfg.n_layers,
        "dim": cfg.dim,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "experts": cfg.num_experts,
        "top_k": cfg.top_k if cfg.num_experts else 0,
        "tied_embeddings": cfg.tie_embeddings,
        "parameters": cfg.param_count(),
        "active_parameters": cfg.param_count(active=True),
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    for key, value in summary.items():
        typer.echo(
            f"{key:18s} {value:,}"
            if isinstance(value, int) and not isinstance(value, bool)
            else f"{key:18s} {value}"
        )


@model_app.command("import")
def import_(
    source: SourceArg,
    out: Annotated[Path, typer.Option("--out", help="Checkpoint directory to create.")],
) -> None:
    """Convert a pretrained checkpoint into a Crucible checkpoint directory, with its tokenizer."""
    from crucible.model.hf import CheckpointError, load_pretrained
    from crucible.model.io import save_checkpoint
    from crucible.model.sources import SourceError, load_tokenizer, resolve

    try:
        found = resolve(source)
        if found.kind == "preset":
            raise SourceError("a preset has no pretrained weights to import; name a checkpoint")
        model = load_pretrained(found.value)
        try:
            tokenizer = load_tokenizer(source)
        except SourceError:  # a checkpoint without tokenizer files: the weights alone
            tokenizer = None
        save_checkpoint(model, out, tokenizer=tokenizer)
    except (SourceError, CheckpointError, OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"{out}: {model.cfg.family}, {model.cfg.param_count():,} parameters")


@model_app.command("export")
def export(
    out: Annotated[Path, typer.Option("--out", help="Hugging Face directory to write.")],
    checkpoint: Annotated[Path | None, typer.Option(help="A Crucible checkpoint directory.")] = None,
    run: Annotated[str | None, typer.Option(help="A run whose published weights to export.")] = None,
    version: Annotated[
        int | None, typer.Option(help="The run's weight version (default: the latest).")
    ] = None,
    adapter: Annotated[
        bool,
        typer.Option(
            "--adapter",
            help="A model.lora run: write its adapters as a PEFT adapter directory, not merged weights.",
        ),
    ] = False,
) -> None:
    """Write weights as a Hugging Face checkpoint that transformers, vLLM or SGLang load (a run's adapters
    merged into them), or a run's adapters alone as a PEFT adapter (--adapter)."""
    import shutil

    from crucible.model import Transformer
    from crucible.model.hf import CheckpointError, export_pretrained, export_weights
    from crucible.model.io import load_checkpoint
    from crucible.model.lora import export_adapter, merge

    if (checkpoint is None) == (run is None):
        raise _fail("give exactly one of --checkpoint and --run")
    if adapter and run is None:
        raise _fail("--adapter exports a run's adapters: give --run")
    try:
        if checkpoint is not None:
            model = load_checkpoint(checkpoint)
            cfg = model.cfg
            export_pretrained(model, out)
        else:
            assert run is not None  # exactly one of the two, checked above
            source, cfg, state = asyncio.run(_run_weights(run, version))
            plain = merge(state, cfg)  # the adapters of a model.lora run folded in
            Transformer(cfg, precision="fp32").load_state_dict(plain, strict=True)  # the weights fit
            if adapter:
                export_adapter(state, out, base_model=source)
                typer.echo(f"{out}: PEFT adapter of {source}")
                return
            export_weights(plain, cfg, out)
    except (CheckpointError, OSError, ValueError, LookupError) as exc:
        raise _fail(str(exc)) from None
    if checkpoint is not None:  # the tokenizer's files travel with the weights
        for file in checkpoint.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                shutil.copy2(file, out / file.name)
    typer.echo(f"{out}: {cfg.family or 'llama'}, {cfg.param_count():,} parameters")


async def _run_weights(run_id: str, version: int | None):
    """A run's model source, architecture and published weights (over the bus and the object store)."""
    from crucible.bus import Bus
    from crucible.clients.checkpoints import load_weights
    from crucible.model.sources import model_config
    from crucible.objectstore import ObjectStore
    from crucible.runs import run_config
    from crucible.settings import CommonSettings

    settings = CommonSettings()
    store = ObjectStore.from_settings(settings)
    bus = await Bus.connect(settings, store=store, name="cli")
    try:
        config = await run_config(bus, run_id)
        if config is None:
            raise LookupError(f"no run {run_id} on the bus at {settings.nats_url}")
        _manifest, state = await load_weights(bus=bus, store=store, run_id=run_id, version=version)
    finally:
        await bus.close()
    return config.model.source, model_config(config.model.source), state


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
