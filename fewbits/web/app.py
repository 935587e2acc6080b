"""The FastAPI app of `fewbits ui`: static pages and a JSON API over the library's own functions.

    POST /api/plan         the decode explorer (fewbits.web.service.explore over fewbits.cost.report)
    POST /api/try          64 weights through one quantiser (fewbits.eval.playground, as `fewbits try`)
    POST /api/layer-error  the one-layer experiment (fewbits.eval.layer_error.experiment)
    GET  /api/options      choices and defaults of the pages
    GET  /api/results[/N]  report files under the folder given with `fewbits ui --results`

Nothing a request sends is written to disk or evaluated: a model is a preset name or the fields of a
config.json read as data, a profile is one the server was started with, a report is named by number.
Bad input is a 4xx whose `detail` is one line naming the field; bodies over `MAX_BODY` bytes are a 413.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from fewbits.web.schemas import LayerErrorRequest, PlanRequest, TryRequest

STATIC = Path(__file__).parent / "static"
MAX_BODY = 1_000_000
PAGES = {"/": "explorer.html", "/playground": "playground.html", "/results": "results.html"}


class InputError(ValueError):
    """A request the library refuses; its message goes to the page as it is."""


def _one_line(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {str(err.get('msg', 'invalid')).removeprefix('Value error, ')}")
    return "; ".join(parts)


def create_app(results: str | Path | None = None, profiles: tuple[str | Path, ...] = ()) -> FastAPI:
    """The app; `results` is the only folder whose reports it reads, `profiles` the probed profile files it offers."""
    from fewbits.cost.profile import load_profile
    from fewbits.web.results import ResultsFolder

    probed = {}
    for p in profiles:
        prof = load_profile(p)
        probed[prof.name] = (prof, str(p))
    folder = ResultsFolder(results) if results is not None else None
    app = FastAPI(title="fewbits ui", version="1", description=__doc__)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next: Any) -> Any:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
            return JSONResponse({"detail": f"request body over {MAX_BODY:,} bytes"}, status_code=413)
        if request.method in ("POST", "PUT", "PATCH") and size is None:
            body = await request.body()
            if len(body) > MAX_BODY:
                return JSONResponse({"detail": f"request body over {MAX_BODY:,} bytes"}, status_code=413)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _one_line(exc)}, status_code=422)

    @app.exception_handler(ValueError)
    async def _refused(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse({"detail": str(exc).splitlines()[0] if str(exc) else type(exc).__name__},
                            status_code=422)

    @app.get("/api/options")
    def get_options() -> dict[str, Any]:
        from fewbits.web.service import options

        return options(probed)

    @app.post("/api/plan")
    def post_plan(req: PlanRequest) -> dict[str, Any]:
        from fewbits.web.service import explore

        return explore(_inputs(req, probed))

    @app.post("/api/try")
    def post_try(req: TryRequest) -> dict[str, Any]:
        from fewbits.eval.playground import playground_spec, try_quantiser

        spec = playground_spec(req.family, req.bits, req.group, req.asym, req.full_grid)
        return try_quantiser(spec, req.weights, req.seed, req.outlier).to_dict()

    @app.post("/api/layer-error")
    def post_layer_error(req: LayerErrorRequest) -> dict[str, Any]:
        from fewbits.eval.layer_error import experiment

        if req.outlier_channel is not None and req.outlier_channel >= req.cols:
            raise InputError(f"outlier_channel {req.outlier_channel} is outside 0..{req.cols - 1}")
        return experiment(tuple(req.weights), req.rows, req.cols, req.w_std, req.outlier_channel,
                          req.outlier_value, req.seed, req.threshold, "fp64")

    @app.get("/api/results")
    def get_results() -> dict[str, Any]:
        if folder is None:
            return {"root": None, "reports": [],
                    "hint": "start with `fewbits ui --results DIR` to open a report folder"}
        return {"root": folder.root.name, "reports": folder.listing()}

    @app.get("/api/results/{index}")
    def get_result(index: int) -> dict[str, Any]:
        if folder is None:
            raise InputError("no report folder: start with `fewbits ui --results DIR`")
        return folder.read(index)

    for route, name in PAGES.items():
        app.add_api_route(route, _page(name), include_in_schema=False, methods=["GET"])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _page(name: str) -> Any:
    def page() -> FileResponse:
        return FileResponse(STATIC / name, media_type="text/html")

    return page


def _inputs(req: PlanRequest, probed: dict[str, Any]) -> Any:
    """The explorer's state with names resolved on the server: a preset (never a path), a device of the table,
    a built-in or probed profile."""
    from fewbits.models.presets import get_preset
    from fewbits.models.spec import ModelSpec
    from fewbits.web.service import ExploreInputs

    if req.config is not None:
        stem = Path(req.config_name).stem or "uploaded"
        model: Any = ModelSpec.from_config_dict(req.config, source=req.config_name, name=stem)
        model_arg = req.config_name
    else:
        model, model_arg = get_preset(req.model), req.model
    if req.profile in ("seed", "default"):
        profile: Any = req.profile
        profile_arg = req.profile
    elif req.profile in probed:
        profile, profile_arg = probed[req.profile]
    else:
        raise InputError(f"unknown profile {req.profile!r}; known: {', '.join(['seed', 'default', *probed])}")
    return ExploreInputs(model=model, device=req.device, weights=req.weights, kv=req.kv, batch=req.batch,
                         context=req.context, devices=req.devices, profile=profile,
                         table_weights=tuple(req.table_weights), table_kv=tuple(req.table_kv),
                         sweep_axis=req.sweep_axis, model_arg=model_arg, profile_arg=profile_arg)
