"""The web pages: the list of runs, one run (plots, exports, every attempt and trial), a submit
form and the token form. Server-rendered (Jinja2 templates in `api/web/templates/`, plots as SVG
from `api.web.run_plots`); the one script (`api/web/static/autotune.js`) copies exports and
refreshes an unfinished run's page, and every page works without it.

Pages follow the API's token rules. The browser keeps the token in a cookie set by the token
form: HttpOnly, so no script (and no page) ever shows it, and SameSite=Strict, so that another
site's links and forms do not carry it. SameSite is not enough: a "site" is the registrable
domain, so a page on another port of the same host, or on a sibling subdomain, still sends the
cookie. So every form POST must come from this server's own pages: a browser says where a form
was sent from (`Origin`, else `Referer`), and one from anywhere else is refused with 403 (a
forged submission, or a login CSRF that would plant the attacker's token). Clients that send
neither header (curl, scripts) are not browsers holding a victim's cookie.
"""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import yaml
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api import comparison, submissions
from api.deps import AppContext, Role, check_token, context_of, is_known_token
from api.errors import ApiError, Forbidden, InvalidToken, NoComparison, RunNotFound
from api.store import offers, runreads, runstore
from api.web.charts import render_svg
from api.web.run_plots import (
    capacity_bytes,
    latest_attempts,
    layouts_chart,
    memory_chart,
    throughput_chart,
)
from autotune.core.bytesize import format_bytes
from autotune.core.errors import SpecError
from autotune.core.exports import render_exports
from autotune.core.exports.titles import EXPORT_TITLES
from autotune.core.gpus.catalogue import GPUS
from autotune.core.schemas import DeviceInfo, DeviceKind, checkpointing_label
from autotune.core.specfile import parse_spec_text
from autotune.remote.protocol import MAX_INT, Run, RunCreate, RunStatus, fingerprint

TOKEN_COOKIE = "autotune_token"
PAGE_SIZE = 25
# How often an unfinished run's page asks whether anything new arrived (a count query).
POLL_MS = 1000
_TOKEN_COOKIE_S = 365 * 24 * 3600
_MAX_PAGE = 10**6
_FILTER_MAX = 300


def device_label(label: str) -> str:
    """A stored device label for people: `emulated:4294967296` reads `emulated 4.00 GiB`."""
    kind, _, what = label.partition(":")
    return f"{kind} {format_bytes(int(what)) if what.isdigit() else what}".strip()


templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
templates.env.filters["bytes"] = format_bytes
templates.env.filters["device_label"] = device_label
templates.env.globals["checkpointing_label"] = checkpointing_label

router = APIRouter(include_in_schema=False)


def _authorize(request: Request, role: Role) -> None:
    check_token(context_of(request).settings, role, request.cookies.get(TOKEN_COOKIE) or None)


def _token_page(request: Request, error: ApiError, *, next_url: str) -> HTMLResponse:
    """The token form in place of a page the visitor may not see, saying why."""
    saved = bool(request.cookies.get(TOKEN_COOKIE))
    if isinstance(error, InvalidToken):
        message = (
            "The token saved in this browser is not known to this server "
            "(it may have been rotated). Enter a valid token."
        )
    elif isinstance(error, Forbidden):
        message = (
            "The token saved in this browser may read runs but not submit them: "
            "submitting needs a client token."
        )
    else:
        message = "This server shows runs only to holders of a token. Enter a client token."
    return templates.TemplateResponse(
        request,
        "token.html",
        {"message": message, "next_url": next_url, "saved": saved},
        status_code=error.status_code,
    )


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _netloc(scheme: str, host: str) -> str:
    """`host[:port]` without the scheme's default port, lower-cased."""
    host = host.lower()
    port = _DEFAULT_PORTS.get(scheme)
    return host.removesuffix(f":{port}") if port is not None else host


def _from_this_site(request: Request) -> bool:
    """Whether a form POST came from this server's pages (see the module docstring)."""
    sent_from = request.headers.get("origin") or request.headers.get("referer")
    if sent_from is None:
        return True
    try:
        origin = urlsplit(sent_from)
    except ValueError:  # an unbalanced IPv6 bracket
        return False
    if origin.scheme not in _DEFAULT_PORTS or not origin.netloc:
        return False  # "null" (a sandboxed frame, a file), or nonsense
    here = request.url
    # The browser's view of this server is the Host it sent (a proxy passes it on), and the
    # scheme it used, which the proxy states (X-Forwarded-Proto, see the README).
    host = request.headers.get("host", here.netloc)
    if here.scheme == "https" and origin.scheme != "https":
        return False
    return _netloc(origin.scheme, origin.netloc) == _netloc(here.scheme, host)


def _cross_site(request: Request) -> HTMLResponse:
    return templates.TemplateResponse(
        request,
        "token.html",
        {
            "message": "This form was sent from another site, so it was refused. "
            "Open this server's own page and send it from there.",
            "next_url": "/",
            "saved": bool(request.cookies.get(TOKEN_COOKIE)),
        },
        status_code=403,
    )


def _safe_next(url: str) -> str:
    """Only a path of this site: the form must not redirect anywhere else."""
    # Browsers read "/\\host" as "//host": another site, as much as "//host" is.
    local = url.startswith("/") and not url.startswith(("//", "/\\"))
    return url if local and url.isprintable() else "/"


async def _form(request: Request) -> dict[str, str]:
    # The app's max_body_size refuses a larger body (413) before it is read here.
    body = await request.body()
    fields = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


def _day(text: str | None, *, end: bool) -> datetime | None:
    if not text:
        return None
    try:
        day = date.fromisoformat(text)
    except ValueError:
        return None
    return datetime.combine(day, time.max if end else time.min, tzinfo=UTC)


def _page_number(text: str) -> int:
    """The `?page=` asked for, within [1, 10^6]: a page answers with a page, never the API's
    JSON 422 (a hand-edited URL is not an API call)."""
    number = int(text) if text.isascii() and text.isdigit() and len(text) <= 7 else 1
    return min(max(number, 1), _MAX_PAGE)


@router.get("/", response_class=HTMLResponse)
def runs_page(
    request: Request,
    status: str = "",
    model: str = "",
    device: str = "",
    since: str = "",
    until: str = "",
    page: str = "1",
) -> Response:
    """Every run, newest first, filtered and paged. Filters longer than any stored value
    are cut (they match nothing either way)."""
    try:
        _authorize(request, Role.READER)
    except ApiError as error:
        return _token_page(request, error, next_url=str(request.url.path))
    model, device = model[:_FILTER_MAX], device[:_FILTER_MAX]
    since, until = since[:10], until[:10]
    number = _page_number(page)
    wanted = RunStatus(status) if status in {s.value for s in RunStatus} else None
    where = runstore.RunFilter(
        status=wanted,
        model=model.strip() or None,
        device=device.strip() or None,
        created_after=_day(since, end=False),
        created_before=_day(until, end=True),
    )
    context = context_of(request)
    listing = runreads.list_runs(
        context, where=where, limit=PAGE_SIZE, offset=(number - 1) * PAGE_SIZE
    )
    filters = {"status": status, "model": model, "device": device, "since": since, "until": until}
    kept = {k: v for k, v in filters.items() if v}
    pages = max(1, math.ceil(listing.total / PAGE_SIZE))
    return templates.TemplateResponse(
        request,
        "runs.html",
        {
            "runs": listing.items,
            "total": listing.total,
            "page": number,
            "pages": pages,
            "first": listing.offset + 1,
            "last": listing.offset + len(listing.items),
            "filters": filters,
            "statuses": [s.value for s in RunStatus],
            "newer_url": f"/?{urlencode({**kept, 'page': number - 1})}" if number > 1 else None,
            "older_url": (
                f"/?{urlencode({**kept, 'page': number + 1})}" if number < pages else None
            ),
            "last_url": f"/?{urlencode({**kept, 'page': pages})}",
        },
    )


def _comparison(context: AppContext, run_id: int) -> Any:
    try:
        with context.db.read() as session:
            return comparison.compare_run(session, run_id=run_id)
    except NoComparison:
        return None


def _spec_yaml(run: Run) -> str:
    return yaml.safe_dump(
        run.spec.model_dump(mode="json", exclude_none=True), sort_keys=False
    ).rstrip()


def _run_context(context: AppContext, run: Run) -> dict[str, Any]:
    exports = render_exports(run.exports) if run.exports is not None else {}
    trials = sorted(run.trials, key=lambda t: (t.claim_number, t.trial.number))
    return {
        "run": run,
        "spec_yaml": _spec_yaml(run),
        "capacity_bytes": capacity_bytes(run),
        "memory_svg": render_svg(memory_chart(run)),
        "throughput_svg": render_svg(throughput_chart(run)),
        "layouts_svg": render_svg(layouts_chart(run)) if run.layouts else None,
        "attempt_count": len(latest_attempts(run)),
        "attempts": run.attempts,
        "trials": trials,
        "exports": [(key, EXPORT_TITLES.get(key, key), text) for key, text in exports.items()],
        "comparison": _comparison(context, run.id) if run.status.is_finished() else None,
        "finished": run.status.is_finished(),
        "poll_ms": POLL_MS,
    }


def _run_id(text: str) -> int:
    """The id in a page's path; anything that is not a stored run's id is a missing run (a page
    answers 404 with a page, not the API's 422 about the path's type)."""
    run_id = int(text) if text.isascii() and text.isdigit() and len(text) <= 19 else 0
    if not 1 <= run_id <= MAX_INT:
        raise RunNotFound(run_id)
    return run_id


@router.get("/runs/{run_ref}", response_class=HTMLResponse)
def run_page(request: Request, run_ref: str) -> Response:
    """One run: what was asked, what was found, and how to use it."""
    try:
        _authorize(request, Role.READER)
    except ApiError as error:
        return _token_page(request, error, next_url=str(request.url.path))
    context = context_of(request)
    try:
        run = runreads.fresh_run(context, _run_id(run_ref))
    except RunNotFound:
        return templates.TemplateResponse(
            request, "missing.html", {"run_ref": run_ref}, status_code=404
        )
    return templates.TemplateResponse(request, "run.html", _run_context(context, run))


@router.get("/runs/{run_ref}/progress")
def run_progress(request: Request, run_ref: str) -> Response:
    """What the run page polls while the run is unfinished: its status and how many attempts
    and trials are stored. A change means the page has something new to show. (An error is
    the API's JSON error: the script reads it, not a person.)"""
    _authorize(request, Role.READER)
    progress = runreads.progress(context_of(request), _run_id(run_ref))
    return JSONResponse(
        {"status": progress.status.value, "attempts": progress.attempts, "trials": progress.trials}
    )


def _offered(context: AppContext) -> list[DeviceInfo]:
    with context.db.read() as session:
        return offers.offered_devices(
            session, now=context.clock(), window_s=context.settings.offer_window_s
        )


def _submit_form(
    request: Request,
    form: dict[str, str],
    errors: list[str],
    status_code: int = 200,
    offered: list[DeviceInfo] | None = None,
) -> HTMLResponse:
    context = context_of(request)
    devices = _offered(context) if offered is None else offered
    return templates.TemplateResponse(
        request,
        "submit.html",
        {
            "form": form,
            "errors": errors,
            "gpus": sorted(gpu.name for gpu in GPUS),
            "offered": list(dict.fromkeys(_offer_label(d) for d in devices)),
            "offer_minutes": max(1, round(context.settings.offer_window_s / 60)),
        },
        status_code=status_code,
    )


_DEFAULT_FORM = {"spec": "", "kind": "emulated", "memory": "24GiB", "gpu": "", "name": ""}


def _offer_label(device: DeviceInfo) -> str:
    if device.kind is DeviceKind.ESTIMATE:
        return f"estimates for {device.gpu}"
    if device.kind is DeviceKind.EMULATED:
        return f"emulated {device.gpu or format_bytes(device.capacity_bytes)}"
    return f"{device.name} ({format_bytes(device.total_memory_bytes)})"


def _form_for(device: DeviceInfo) -> dict[str, str]:
    """The form's target fields for a device a worker offers, so that the default is one a
    worker takes (not 24 GiB that no worker may have)."""
    if device.kind is DeviceKind.ESTIMATE:
        return {"kind": "estimate", "gpu": device.gpu or "", "memory": "", "name": ""}
    if device.kind is DeviceKind.EMULATED and device.gpu is not None:
        return {"kind": "emulated", "gpu": device.gpu, "memory": "", "name": ""}
    if device.kind is DeviceKind.EMULATED:
        return {"kind": "emulated", "gpu": "", "memory": str(device.capacity_bytes), "name": ""}
    memory = str(device.total_memory_bytes)
    return {"kind": "cuda", "gpu": "", "memory": memory, "name": device.name}


def _default_form(offered: list[DeviceInfo]) -> dict[str, str]:
    """The newest offered device that measures (an estimate only when nothing else is)."""
    measuring = [d for d in offered if d.kind is not DeviceKind.ESTIMATE]
    chosen = (measuring or offered)[:1]
    return {**_DEFAULT_FORM, **(_form_for(chosen[0]) if chosen else {})}


@router.get("/submit", response_class=HTMLResponse)
def submit_page(request: Request) -> Response:
    try:
        _authorize(request, Role.CLIENT)
    except ApiError as error:
        return _token_page(request, error, next_url="/submit")
    offered = _offered(context_of(request))
    return _submit_form(request, _default_form(offered), [], offered=offered)


def _target(form: dict[str, str]) -> dict[str, Any]:
    kind = form.get("kind", "emulated")
    if kind == "estimate":
        return {"kind": "estimate", "gpu": form.get("gpu", "")}
    if kind == "cuda":
        return {"kind": "cuda", "name": form.get("name", ""), "memory_bytes": form.get("memory")}
    if form.get("gpu"):
        return {"kind": "emulated", "gpu": form["gpu"]}
    return {"kind": "emulated", "memory_bytes": form.get("memory")}


def _field_errors(error: ValidationError) -> list[str]:
    return [
        f"{'.'.join(str(part) for part in problem['loc']) or 'spec'}: {problem['msg']}"
        for problem in error.errors()
    ]


def _run_create(form: dict[str, str]) -> RunCreate:
    """The submission the form describes.

    Raises:
        SpecError: the spec text is too long or deep, has aliases, or is not YAML.
        ValidationError: the spec or the target is invalid.
    """
    spec = parse_spec_text(form["spec"])
    return RunCreate.model_validate({"spec": spec, "device": _target(form)})


@router.post("/submit", response_class=HTMLResponse)
async def submit_form(request: Request) -> Response:
    """Queue the pasted spec on the chosen target (or join its twin) and show its run page."""
    if not _from_this_site(request):
        return _cross_site(request)
    try:
        _authorize(request, Role.CLIENT)
    except ApiError as error:
        return _token_page(request, error, next_url="/submit")
    form = {**_DEFAULT_FORM, **(await _form(request))}
    # Parsing and validating take up to a second for the largest spec text allowed: off the
    # event loop, which must go on answering every other request meanwhile.
    try:
        run_create = await run_in_threadpool(_run_create, form)
    except SpecError as error:
        return _submit_form(request, form, [str(error)], 422)
    except ValidationError as error:
        return _submit_form(request, form, _field_errors(error), 422)
    context = context_of(request)
    if submissions.refuses_factory(context, run_create):
        message = f"spec.model.factory: {submissions.FACTORY_REFUSED}"
        return _submit_form(request, form, [message], 422)
    run_fingerprint = fingerprint(run_create.spec, run_create.device, context.version)
    # The form is async (it reads the body); the database is not: off the event loop.
    run_id, _, _ = await run_in_threadpool(
        submissions.submit, context, run_create, run_fingerprint
    )
    return RedirectResponse(f"/runs/{run_id}", status_code=303)


@router.get("/token", response_class=HTMLResponse)
def token_page(request: Request, next: str = "/") -> Response:  # noqa: A002 (the form's name)
    return templates.TemplateResponse(
        request,
        "token.html",
        {
            "message": None,
            "next_url": _safe_next(next),
            "saved": bool(request.cookies.get(TOKEN_COOKIE)),
        },
    )


@router.post("/token", response_class=HTMLResponse)
async def save_token(request: Request) -> Response:
    """Keep a token this server knows in the browser's cookie; refuse any other."""
    if not _from_this_site(request):
        return _cross_site(request)
    form = await _form(request)
    token = form.get("token", "").strip()
    next_url = _safe_next(form.get("next", "/"))
    if not is_known_token(context_of(request).settings, token):
        return templates.TemplateResponse(
            request,
            "token.html",
            {
                "message": "That token is not known to this server. Check it and try again.",
                "next_url": next_url,
                "saved": bool(request.cookies.get(TOKEN_COOKIE)),
            },
            status_code=401,
        )
    response = RedirectResponse(next_url, status_code=303)
    response.set_cookie(
        TOKEN_COOKIE,
        token,
        max_age=_TOKEN_COOKIE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/token/forget")
def forget_token(request: Request) -> Response:
    if not _from_this_site(request):
        return _cross_site(request)
    response = RedirectResponse("/token", status_code=303)
    response.delete_cookie(TOKEN_COOKIE, httponly=True, samesite="strict")
    return response
