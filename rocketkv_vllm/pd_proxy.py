"""A small HTTP proxy for disaggregated prefill and decode (issue 60).

Clients talk to it as to any OpenAI-compatible server. Each completion or
chat completion is sent first to a prefill engine with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}`` (vLLM's pull-mode
``NixlConnector``), then to a decode engine with the ``kv_transfer_params``
the prefill engine answered, and the decode engine's answer (streamed or
not) goes back to the client. Several engines of a kind are used in turn.

    python -m rocketkv_vllm.pd_proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

An error from either engine (an HTTP status other than 200, ROCKETKV's
per-request refusals included) reaches the client with its status and
body; an engine that cannot be reached is a 502 naming it. Requests this
proxy cannot split correctly are refused with a 400 naming the field.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging

from aiohttp import ClientError, ClientSession, ClientTimeout, web

logger = logging.getLogger("rocketkv_vllm.pd_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
# What vLLM's pull connector reads on the prefill side: decode elsewhere.
PREFILL_TRANSFER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def refusal(body: dict) -> str | None:
    """Why a request cannot go through prefill-then-decode, or None."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    if body.get("kv_transfer_params") is not None:
        return "kv_transfer_params is set by the P/D proxy; send the request without it"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        # The decode engine would fork one pulled prompt into several requests.
        return "n and best_of must be 1 through the P/D proxy (got n={}, best_of={})".format(
            body.get("n"), body.get("best_of")
        )
    if body.get("use_beam_search"):
        return "use_beam_search is not supported through the P/D proxy"
    return None


def prefill_request(body: dict) -> dict:
    """The prefill engine's copy: one token, not streamed, decode elsewhere."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_TRANSFER)
    return out


def decode_request(body: dict, transfer: dict | None) -> dict:
    """The decode engine's copy: the client's request with the prefill
    engine's transfer params (None: the prefill engine offered nothing, e.g.
    its one token ended the request, and the decode engine computes the
    prompt itself)."""
    return dict(body, kv_transfer_params=transfer)


def _forward_headers(request: web.Request) -> dict:
    keep = ("authorization", "x-request-id")
    return {k: v for k, v in request.headers.items() if k.lower() in keep}


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 3600.0):
        if not prefill or not decode:
            raise ValueError("--prefill and --decode each need at least one URL")
        self.prefill, self.decode = list(prefill), list(decode)
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        self._timeout = ClientTimeout(total=timeout_s)
        self._session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=self._timeout)

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        for route in ROUTES:
            app.router.add_post(route, self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def complete(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        why = refusal(body)
        if why is not None:
            return _error(400, why)
        headers = _forward_headers(request)
        prefill_url = next(self._next_prefill) + request.path
        try:
            async with self._session.post(
                prefill_url, json=prefill_request(body), headers=headers
            ) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    return _relay(resp.status, payload, resp.content_type)
                transfer = json.loads(payload).get("kv_transfer_params")
        except ClientError as err:
            return _error(502, f"prefill engine {prefill_url} unreachable: {err}")
        decode_url = next(self._next_decode) + request.path
        try:
            async with self._session.post(
                decode_url, json=decode_request(body, transfer), headers=headers
            ) as resp:
                if resp.status != 200 or not body.get("stream"):
                    return _relay(resp.status, await resp.read(), resp.content_type)
                out = web.StreamResponse(status=200, headers={"Content-Type": resp.content_type})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except ClientError as err:
            return _error(502, f"decode engine {decode_url} unreachable: {err}")

    async def models(self, request: web.Request) -> web.Response:
        url = self.decode[0] + "/v1/models"
        try:
            async with self._session.get(url, headers=_forward_headers(request)) as resp:
                return _relay(resp.status, await resp.read(), resp.content_type)
        except ClientError as err:
            return _error(502, f"decode engine {url} unreachable: {err}")

    async def health(self, request: web.Request) -> web.Response:
        down = []
        for url in self.prefill + self.decode:
            try:
                async with self._session.get(url + "/health") as resp:
                    if resp.status != 200:
                        down.append(url)
            except ClientError:
                down.append(url)
        if down:
            return _error(503, "engines not healthy: " + ", ".join(down))
        return web.Response(status=200)


def _relay(status: int, payload: bytes, content_type: str) -> web.Response:
    return web.Response(status=status, body=payload, content_type=content_type)


def _error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill engines' URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode engines' URLs")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    proxy = Proxy([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode])
    logger.info("P/D proxy: prefill %s, decode %s", proxy.prefill, proxy.decode)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
