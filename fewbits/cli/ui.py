"""`fewbits ui`: serve the decode explorer, the quantiser playground and the results pages locally."""

from __future__ import annotations

import click


@click.command("ui")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (127.0.0.1: this machine only; 0.0.0.0 exposes the pages to the network).")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True, help="Port (0: any free).")
@click.option("--results", "results", type=click.Path(exists=True, file_okay=False), default=None,
              help="A report folder (of demo, eval, quantize or bench runs) for the results page; the only "
                   "files the server reads.")
@click.option("--profile", "profiles", type=click.Path(exists=True, dir_okay=False), multiple=True,
              help="A probed profile JSON (`fewbits probe -o FILE`) the explorer offers; repeatable.")
@click.option("--no-open", is_flag=True, help="Do not open a browser.")
def ui_cmd(host: str, port: int, results: str | None, profiles: tuple[str, ...], no_open: bool) -> None:
    """Serve the pages of fewbits on HOST:PORT (needs the ui extra: pip install 'fewbits[ui]')."""
    try:
        import uvicorn

        from fewbits.web.app import create_app
    except ImportError as e:
        raise click.ClickException(f"fewbits ui needs FastAPI and uvicorn ({e.name} is missing): "
                                   "pip install 'fewbits[ui]'") from None
    try:
        app = create_app(results, profiles)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    # keep-alive longer than uvicorn's 5 s: a pooled client connection closed while a request is sent is a reset
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host

    if not no_open:
        import threading
        import time
        import webbrowser

        def _open() -> None:
            for _ in range(100):
                if server.started:
                    break
                time.sleep(0.05)
            port_now = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
            webbrowser.open(f"http://{url_host}:{port_now}/")

        threading.Thread(target=_open, daemon=True).start()
    click.echo(f"fewbits ui on http://{url_host}:{port}/ (Ctrl-C stops it)")
    server.run()
