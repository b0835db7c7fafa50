"""Joining a Ray cluster that uses token authentication, from a client or a node.

Ray (2.52 and later) turns token authentication on for ``ray start --head``: the head
keeps a token (``~/.ray/auth_token``, or the file named by ``RAY_AUTH_TOKEN_PATH``,
or the value of ``RAY_AUTH_TOKEN``) and refuses any process that does not present it.
A process that joins by an explicit address presents it only when
``RAY_AUTH_MODE=token`` is set in its environment; without that, Ray fails with
``AuthenticationError ... RAY_AUTH_MODE is currently 'disabled'``.

:func:`prepare_token_auth` runs before ``ray.init(address=...)``: when a token can
be found it turns the mode on for this process (authentication stays on; nothing
here ever disables it). :class:`ClusterAuthError` is the clear error raised when the
cluster refused us for want of a token.
"""

from __future__ import annotations

import os

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_PATH = os.path.join("~", ".ray", "auth_token")


class ClusterAuthError(ConnectionError):
    """The Ray cluster at an address refused this process: no (or a wrong) token."""


def token_source() -> str | None:
    """Where this process's token comes from: ``RAY_AUTH_TOKEN``, the path in
    ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``; ``None`` when there is none.

    Raises:
        ClusterAuthError: ``RAY_AUTH_TOKEN_PATH`` names a file that does not exist.
    """
    if os.environ.get(TOKEN):
        return TOKEN
    path = os.environ.get(TOKEN_PATH)
    if path:
        if not os.path.isfile(os.path.expanduser(path)):
            raise ClusterAuthError(f"{TOKEN_PATH}={path!r}: no such file; point it at the "
                                   "cluster's token file (`dlrover cluster env` prints it "
                                   "for a cluster started with `dlrover cluster up`)")
        return path
    default = os.path.expanduser(DEFAULT_TOKEN_PATH)
    return default if os.path.isfile(default) else None


def _reload_ray_config() -> None:
    """Make an already imported Ray see the new ``RAY_AUTH_MODE`` (Ray does the same
    in ``authentication_token_setup._enable_token_auth``)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # a Ray without token authentication
        pass


def prepare_token_auth(address: str) -> str | None:
    """Before joining the cluster at ``address``: turn ``RAY_AUTH_MODE=token`` on in
    this process when a token is available, the mode is not set, and the GCS does not
    answer a call without a token (it refuses it, or ``address`` is not a plain
    ``HOST:PORT`` that can be asked); an explicit
    ``RAY_AUTH_MODE`` is respected. Returns the token's source, or ``None``.

    Raises:
        ClusterAuthError: ``RAY_AUTH_MODE=token`` is set but no token can be found.
    """
    src = token_source()
    mode = os.environ.get(AUTH_MODE)
    # a token file alone (``ray start --head`` leaves ~/.ray/auth_token behind) does not
    # mean this cluster wants it: the mode is inherited by every process this one starts
    # (``Cluster.add_node``'s raylet), and a raylet with the mode on under a head without
    # it refuses the GCS's requests (its placement groups never become ready)
    if mode is None and src is not None and probe_gcs(address, None) != "ok":
        os.environ[AUTH_MODE] = "token"
        _reload_ray_config()
    elif mode == "token" and src is None:
        raise missing_token_error(address)
    return src


#: Where :func:`notice_once` records that it has spoken (per user).
NOTICE_MARK = os.path.join("~", ".cache", "dlrover", "token-auth-notice")


def quiet_token_auth(starting: bool) -> None:
    """Before ``ray.init`` starts a local cluster (``starting``) or joins the one on this
    machine (``address="auto"``): set ``RAY_AUTH_MODE=token`` where Ray would turn token
    authentication on by itself (a new cluster; a join when a token exists), so that
    Ray does not print its notice on every command; authentication stays on. An
    explicit ``RAY_AUTH_MODE`` is respected. A new cluster gets :func:`notice_once`."""
    if os.environ.get(AUTH_MODE) is not None:
        return
    if starting or token_source() is not None:
        os.environ[AUTH_MODE] = "token"
        _reload_ray_config()
    if starting:
        notice_once()


def notice_once(stream=None) -> bool:
    """Print, once per user (marked in :data:`NOTICE_MARK`), that the clusters this
    command starts use Ray's token authentication and what a process joining one
    needs; True when it printed."""
    import sys

    mark = os.path.expanduser(NOTICE_MARK)
    if os.path.exists(mark):
        return False
    print("note: Ray clusters started by dlrover use Ray's token authentication (the "
          f"token: {os.path.expanduser(DEFAULT_TOKEN_PATH)}); a process joining one by "
          f"address needs {AUTH_MODE}=token and that token (`dlrover cluster env` prints "
          "both). Shown once.", file=stream or sys.stderr, flush=True)
    try:
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        with open(mark, "w") as f:
            f.write("shown\n")
    except OSError:
        pass
    return True


def read_token() -> str | None:
    """This process's token value (see :func:`token_source`), or ``None``."""
    src = token_source()
    if src is None:
        return None
    if src == TOKEN:
        return os.environ[TOKEN].strip()
    with open(os.path.expanduser(src)) as f:
        return f.read().strip()


def probe_gcs(address: str, token: str | None, timeout_s: float = 5.0) -> str:
    """Ask the GCS at ``address`` (``HOST:PORT``) for its cluster id, presenting
    ``token`` (``authorization: Bearer <token>``, as Ray's own clients do) or none.

    Returns ``"ok"``, ``"unauthenticated"`` (gRPC status UNAUTHENTICATED: the cluster
    wants a token we lack, or refused ours) or ``"unreachable"`` (anything else, left
    to ``ray.init`` to report). One call, no retries, unlike ``ray.init``'s 20 s.
    """
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return "unreachable"
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=metadata,
                              timeout=timeout_s)
            return "ok"
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "unauthenticated"
            return "unreachable"


def check_token(address: str) -> None:
    """Before ``ray.init(address=...)``: fail at once, with what to set, when the GCS
    at ``address`` refuses this process's token (or its lack of one).

    Raises:
        ClusterAuthError: the cluster refused us; the message says whether no token
            was found or the one found (and from where) was refused.
    """
    token = read_token() if os.environ.get(AUTH_MODE, "token") == "token" else None
    if probe_gcs(address, token) != "unauthenticated":
        return
    if token is None:
        raise missing_token_error(address)
    raise ClusterAuthError(
        f"the Ray cluster at {address} refused the token from {token_source()}: it is not "
        f"this cluster's token. Point {TOKEN_PATH} at the token file of the cluster's head "
        f"(`dlrover cluster env` names it for a cluster from `dlrover cluster up`)")


def missing_token_error(address: str, cause: BaseException | None = None) -> ClusterAuthError:
    """The error to show when the cluster at ``address`` wants a token we lack."""
    why = f" ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})" if cause else ""
    return ClusterAuthError(
        f"the Ray cluster at {address} refused this process: it uses token "
        f"authentication and no valid token was found{why}. Give this process the "
        f"cluster's token: {TOKEN_PATH}=/path/to/token (the file `ray start --head` "
        f"wrote, ~/.ray/auth_token on the head, or the one `dlrover cluster env` names) "
        f"or {TOKEN}=<token>, with {AUTH_MODE}=token")


def is_auth_failure(exc: BaseException) -> bool:
    """True when ``exc`` (from ``ray.init``) says the cluster refused our token."""
    from ray.exceptions import AuthenticationError

    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, AuthenticationError) or "auth" in text.lower() and (
        "token" in text.lower() or "unauthenticated" in text.lower())
