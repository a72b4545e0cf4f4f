"""`kimi-mlx cluster init`, `kimi-mlx cluster ls` and `kimi-mlx cluster doctor`: make the
cluster secret, list the nodes on the network (checked with an authenticated call when
this machine has the secret), and check them (`cluster.doctor`). The command layer of the cluster, like `cli.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _err(cmd: str, e) -> None:
    print(f"kimi-mlx cluster {cmd}: error: {e}", file=sys.stderr)


def init(args) -> int:
    """`kimi-mlx cluster init`: write the secret (and with --tls the certificate); 1 on failure."""
    from kimi_mlx.cluster.net.auth import AuthError, init_secret, init_tls

    path = Path(args.secret_file).expanduser()
    try:
        if args.tls and path.exists() and not args.force:
            files = []  # keep the secret every node already has; add the certificate
        else:
            files = [init_secret(path, force=args.force)]
        if args.tls:
            files += list(init_tls(path, force=args.force))
    except (FileExistsError, AuthError, OSError) as e:
        _err("init", e)
        return 1
    print(f"wrote {', '.join(str(f) for f in files)} (mode 0600 for keys)")
    home = Path.home()
    shown = [f"~/{f.relative_to(home)}" if f.is_relative_to(home) else str(f) for f in files]
    folder = str(Path(shown[0]).parent)
    print("copy to the same place on every Mac, keeping the mode, e.g.:")
    print(f"  ssh OTHER-MAC mkdir -m700 -p {folder} && scp -p {' '.join(str(f) for f in files)} "
          f"OTHER-MAC:{folder}/")
    return 0


def ls(args) -> int:
    """`kimi-mlx cluster ls`: browse, check with the secret when there is one, print a table
    (or JSON). 2 for bad flags, 1 when no node answered."""
    from kimi_mlx.cluster.net.auth import AuthError, load_secret
    from kimi_mlx.cluster.net.discovery import browse, interface_addresses
    from kimi_mlx.cluster.net.control import ControlClient
    from kimi_mlx.cluster.net.nodes import check_browse_time

    try:
        check_browse_time("--timeout", args.timeout)
        interfaces = interface_addresses(args.interface)
        nodes = browse(args.timeout, interfaces)
    except ValueError as e:
        _err("ls", e)
        return 2
    except OSError as e:  # e.g. an IPv4 address that is on no interface of this host
        _err("ls", f"cannot browse on {args.interface or 'all interfaces'}: {e.strerror or e}")
        return 2
    status, checkpoints = {}, {}
    try:
        secret = load_secret(args.secret_file)
    except AuthError as e:
        secret = None
        print(f"note: not checking nodes ({e})", file=sys.stderr)
    if secret is not None and nodes:
        from kimi_mlx.cluster.net.nodes import check_nodes, held_checkpoints

        t = ControlClient(secret, args.secret_file if args.tls else None)
        ok, bad = check_nodes(nodes, t.stub_for, fp=None, check_version=True,
                              channel_for=t.channel_for)
        for info, reply in ok:
            held = f", layers [{reply.start}, {reply.end})" if reply.state == "ready" else ""
            status[info.node_id] = f"ok ({reply.state}{held}, {reply.sessions} sessions)"
            checkpoints[info.node_id] = held_checkpoints(reply)
        for r in bad:
            status[r.node_id] = r.reason.replace("not answering: ", "advertised but not answering: ")
    if args.json:
        print(json.dumps([dict(vars(n), status=status.get(n.node_id, "unchecked")) for n in nodes],
                         indent=2))
        return 0 if nodes else 1
    if not nodes:
        print(f"no kimi-mlx nodes found in {args.timeout:g} s on {', '.join(interfaces)}")
        return 1
    head = ("node", "address", "proto", "kimi-mlx", "chip", "RAM GB", "usable GB", "GB/s",
            "checkpoints", "status")
    rows = [(n.node_id, n.address, str(n.protocol), n.version, n.chip or "-",
             f"{n.total_memory / 1e9:.0f}", f"{n.usable_memory / 1e9:.0f}",
             f"{n.bandwidth / 1e9:.0f}" if n.bandwidth else "-",
             checkpoints.get(n.node_id, ",".join(n.fingerprints) or "-"),
             status.get(n.node_id, "unchecked")) for n in nodes]
    widths = [max(len(r[j]) for r in rows + [head]) for j in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def doctor(args) -> int:
    """`kimi-mlx cluster doctor`: the checks of `cluster.doctor_run.cluster_checks`, printed
    (or JSON); 1 when a check FAILs, 2 for bad flags."""
    from kimi_mlx.cluster.doctor import exit_status, render
    from kimi_mlx.cluster.doctor_run import DoctorSettings, cluster_checks
    from kimi_mlx.cluster.net.nodes import check_browse_time

    try:
        check_browse_time("--discover-timeout", args.discover_timeout)
    except ValueError as e:
        _err("doctor", e)
        return 2
    s = DoctorSettings(model=args.model, context=args.context, backend=args.backend)
    checks = cluster_checks(s, args.nodes, args.secret_file, args.tls, args.discover_timeout,
                            args.interface)
    print(render(checks, args.json))
    return exit_status(checks)
