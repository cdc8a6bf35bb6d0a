"""`exod chat`: a model's answer streamed from a running daemon's /v1/chat/completions."""

from __future__ import annotations

import click

from exod.cli._common import STATE_DIR, URL, _call_failed, _client


@click.command()
@click.argument("model_id")
@click.argument("prompt")
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=None)
@URL
@STATE_DIR
def chat(model_id: str, prompt: str, max_tokens: int, temperature: float, seed, url, state_dir) -> None:
    """Stream an answer to PROMPT from MODEL_ID on a running daemon."""
    import json

    import httpx
    from httpx_sse import connect_sse

    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
    }
    if seed is not None:
        body["seed"] = seed
    with _client(url, state_dir) as client:
        try:
            with connect_sse(client, "POST", "/v1/chat/completions", json=body, timeout=None) as source:
                if source.response.status_code >= 400:
                    source.response.read()
                    _call_failed(source.response)
                for event in source.iter_sse():
                    if event.data == "[DONE]":
                        continue
                    doc = json.loads(event.data)
                    if "error" in doc:
                        click.echo()
                        raise click.ClickException(doc["error"]["message"])
                    click.echo(doc["choices"][0]["delta"].get("content", ""), nl=False)
        except httpx.HTTPError as exc:
            raise click.ClickException(f"cannot reach the daemon at {client.base_url}: {exc}") from exc
    click.echo()
