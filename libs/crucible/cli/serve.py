"""`crucible serve MODEL --port P`: a model over the OpenAI API (crucible.serving), on loopback unless
told otherwise.

    crucible serve package:smollm2-135m-instruct --port 8000
    crucible serve ./hf-checkpoint --precision bf16 --max-sequences 32

Any OpenAI client then works with base_url http://127.0.0.1:8000/v1. With `--port 0` the system picks
a free port; the first line printed says which. With `--weights-dir DIR`, rollouts can drive it as an
external engine and reload its weights (services.rollout.external).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer


def serve(
    source: Annotated[str, typer.Argument(help="A Hugging Face directory, a .gguf file or package:NAME.")],
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    precision: Annotated[str, typer.Option(help="fp32 | bf16 | mxfp8")] = "fp32",
    name: Annotated[str | None, typer.Option(help="The model id clients name (default: the source).")] = None,
    max_context: Annotated[
        int | None, typer.Option(min=16, help="Tokens per sequence (default: the model's).")
    ] = None,
    max_sequences: Annotated[int, typer.Option(min=1, max=1024, help="Sequences decoded together.")] = 64,
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads (default: torch's).")] = None,
    weights_dir: Annotated[
        Path | None,
        typer.Option(
            help="Allow POST /update_weights_from_disk to load checkpoints from under this directory."
        ),
    ] = None,
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A PEFT LoRA adapter directory to merge into the weights (crucible model export --adapter)."
        ),
    ] = None,
) -> None:
    """Serve a model over the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models."""
    import torch
    import uvicorn

    from crucible.model.hf import CheckpointError
    from crucible.model.sources import SourceError
    from crucible.serving.app import create_app
    from crucible.serving.engine import ServingEngine

    if precision not in ("fp32", "bf16", "mxfp8"):
        typer.echo(f"crucible serve: unknown precision {precision!r} (fp32, bf16 or mxfp8)", err=True)
        raise typer.Exit(2)
    if threads:
        torch.set_num_threads(threads)
    try:
        engine = ServingEngine.from_source(
            source,
            precision=precision,
            name=name or source,
            max_context=max_context,
            max_sequences=max_sequences,
            adapter=adapter,
        )
    except (SourceError, CheckpointError, OSError, ValueError) as exc:
        typer.echo(f"crucible serve: {exc}", err=True)
        raise typer.Exit(2) from None
    listener = socket.create_server((host, port))
    bound = listener.getsockname()[1]
    typer.echo(f"serving {engine.name} on http://{host}:{bound}/v1", err=False)
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, weights_dir=weights_dir), log_level="warning", access_log=False)
    )
    try:
        server.run(sockets=[listener])
    finally:
        engine.close()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
