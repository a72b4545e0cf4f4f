"""Cluster secret and per-call authentication for the stage service.

`kimi-mlx cluster init` writes a random 256-bit secret (hex, file mode 0600) that the user
copies to every Mac. Every RPC carries, in its metadata, an HMAC-SHA256 of the method
name, a timestamp and a random nonce under that secret (`x-kimi-mlx-auth:
v1.<unix seconds>.<nonce hex>.<mac hex>`). The server interceptor checks it in constant
time, refuses a timestamp off by more than `MAX_SKEW_S` or a nonce seen before (replay),
and logs every refusal with the peer and the reason. The secret itself never crosses the
network; `key_id` (an HMAC of a constant) lets peers tell which secret a node uses.

Integrity and confidentiality of the activations are TLS's job (optional, see
`tls_files`); without TLS the stream is authenticated at call start only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import grpc

METADATA_KEY = "x-kimi-mlx-auth"
MAX_SKEW_S = 300
DEFAULT_DIR = Path("~/.kimi-mlx").expanduser()
DEFAULT_SECRET = DEFAULT_DIR / "cluster.key"
TLS_NAME = "kimi-mlx"  # the name inside the cluster certificate; clients check it

log = logging.getLogger(__name__)


class AuthError(ValueError):
    """A missing, unreadable or unsafe secret file (message says how to fix it)."""


def init_secret(path: Path = DEFAULT_SECRET, force: bool = False) -> Path:
    """Write a new random secret (64 hex characters) with mode 0600; returns the path.

    Raises:
        FileExistsError: the file exists and `force` is false.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; use --force to replace it (every node then "
                              "needs the new copy)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def load_secret(path: Path = DEFAULT_SECRET) -> bytes:
    """Read a cluster secret file.

    Raises:
        AuthError: missing file (says to run `kimi-mlx cluster init` or copy it), file
            readable by group or others (says `chmod 600`), or fewer than 32 characters.
    """
    path = Path(path).expanduser()
    try:
        st = path.stat()
        text = path.read_text().strip()
    except FileNotFoundError:
        raise AuthError(f"{path}: no cluster secret; run `kimi-mlx cluster init` on one Mac "
                        "and copy the file to the same place on the others (scp -p)") from None
    except OSError as e:
        raise AuthError(f"{path}: cannot read the cluster secret ({e.strerror})") from None
    if os.name == "posix" and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(f"{path}: cluster secret is readable by other users "
                        f"(mode {stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`")
    if len(text) < 32:
        raise AuthError(f"{path}: cluster secret is too short ({len(text)} characters, need >= 32)")
    return text.encode()


def key_id(secret: bytes) -> str:
    """8 hex characters naming the secret without revealing it."""
    return hmac.new(secret, b"kimi-mlx key id", hashlib.sha256).hexdigest()[:8]


def _mac(secret: bytes, method: str, ts: str, nonce: str) -> str:
    msg = f"{method}\n{ts}\n{nonce}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, now: Optional[float] = None) -> str:
    """The metadata value authenticating one call of `method` ('/pkg.Service/Method')."""
    ts = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(12)
    return f"v1.{ts}.{nonce}.{_mac(secret, method, ts, nonce)}"


class Verifier:
    """Checks `sign` tokens: MAC (constant time), clock skew, replayed nonces."""

    def __init__(self, secret: bytes, max_skew_s: int = MAX_SKEW_S):
        self.secret = secret
        self.max_skew_s = max_skew_s
        self._seen: Dict[str, float] = {}
        self._lock = threading.Lock()

    def check(self, method: str, token: Optional[str], now: Optional[float] = None) -> Optional[str]:
        """None when `token` authenticates `method`, else the reason it does not."""
        if not token:
            return "no credentials (missing or different cluster secret?)"
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != "v1":
            return "malformed credentials"
        _, ts, nonce, mac = parts
        if not hmac.compare_digest(_mac(self.secret, method, ts, nonce), mac):
            return "wrong cluster secret"
        now = time.time() if now is None else now
        try:
            skew = abs(now - int(ts))
        except ValueError:
            return "malformed timestamp"
        if skew > self.max_skew_s:
            return f"clock off by {skew:.0f} s (limit {self.max_skew_s} s): sync the clocks"
        with self._lock:
            if nonce in self._seen:
                return "replayed credentials"
            if len(self._seen) > 100_000 or (self._seen and next(iter(self._seen.values())) < now - self.max_skew_s):
                cutoff = now - self.max_skew_s
                self._seen = {n: t for n, t in self._seen.items() if t >= cutoff}
            self._seen[nonce] = now
        return None


def _deny_handler(handler, reason: str, method: str):
    def deny(request, context):
        log.warning("refused %s from %s: %s", method, context.peer(), reason)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused: {reason}")

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class ServerAuth(grpc.ServerInterceptor):
    """Server interceptor: every call must carry a valid `x-kimi-mlx-auth` token."""

    def __init__(self, secret: bytes):
        self.verifier = Verifier(secret)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        token = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA_KEY:
                token = value
        reason = self.verifier.check(method, token)
        handler = continuation(handler_call_details)
        if reason is None:
            return handler
        return _deny_handler(handler, reason, method)


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class ClientAuth(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client interceptor adding a fresh `sign` token to every call."""

    def __init__(self, secret: bytes):
        self.secret = secret

    def _details(self, details):
        md = list(details.metadata or []) + [(METADATA_KEY, sign(self.secret, details.method))]
        return _ClientCallDetails(details, md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


# -- optional TLS ---------------------------------------------------------------------

def tls_files(secret_path: Path) -> Tuple[Path, Path]:
    """(certificate, private key) paths that go with a secret file: `<name>.crt/.tls.key`."""
    secret_path = Path(secret_path).expanduser()
    return secret_path.with_suffix(".crt"), secret_path.with_suffix(".tls.key")


def init_tls(secret_path: Path, force: bool = False) -> Tuple[Path, Path]:
    """Make the cluster's self-signed certificate (CN/SAN `kimi-mlx`, 10 years) with the
    `openssl` command; every node uses the same pair, copied with the secret.

    Raises:
        FileExistsError: the files exist and `force` is false.
        AuthError: openssl is missing or fails.
    """
    crt, key = tls_files(secret_path)
    if (crt.exists() or key.exists()) and not force:
        raise FileExistsError(f"{crt} exists; use --force to replace it")
    tmp_key = key.with_name(f".{key.name}.tmp")
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
           "-subj", f"/CN={TLS_NAME}", "-addext", f"subjectAltName=DNS:{TLS_NAME}",
           "-keyout", str(tmp_key), "-out", str(crt)]
    old = os.umask(0o077)
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    except FileNotFoundError:
        raise AuthError("TLS needs the `openssl` command") from None
    except subprocess.CalledProcessError as e:
        raise AuthError(f"openssl failed: {e.stderr.decode(errors='replace').strip()}") from None
    finally:
        os.umask(old)
    os.chmod(tmp_key, 0o600)
    os.replace(tmp_key, key)
    return crt, key


def server_credentials(secret_path: Path):
    """grpc server credentials from the cluster certificate (AuthError when missing)."""
    crt, key = tls_files(secret_path)
    try:
        return grpc.ssl_server_credentials([(key.read_bytes(), crt.read_bytes())])
    except FileNotFoundError as e:
        raise AuthError(f"{e.filename}: no TLS files; run `kimi-mlx cluster init --tls`") from None


def channel_credentials(secret_path: Path):
    """grpc channel credentials trusting only the cluster certificate."""
    crt, _ = tls_files(secret_path)
    try:
        return grpc.ssl_channel_credentials(root_certificates=crt.read_bytes())
    except FileNotFoundError as e:
        raise AuthError(f"{e.filename}: no TLS certificate; copy it from the Mac that ran "
                        "`kimi-mlx cluster init --tls`") from None
