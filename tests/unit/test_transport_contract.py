"""Every transfer backend, and the DP group's stand-in for one, keeps messenger/transport.py's contract.

For every registered backend class (imported through the registry; none needs a GPU or its
library to import) and for dp.proxy.ProxyBackend: each member of the `Transport` Protocol exists,
a method with the same parameter names, kinds and defaults, a property or attribute where the
Protocol has a property; likewise `Peer` and `ProxyPeer` against `TransportPeer`. A double
missing any one member is refused by isinstance, and a live shmem backend is a Transport.
"""

from __future__ import annotations

import ast
import inspect
import secrets
import textwrap

import pytest

from sglang_disagg.backends import BackendConfig, create_backend, get_backend, list_backends
from sglang_disagg.backends.base import TransferBackend
from sglang_disagg.backends.peers import Peer
from sglang_disagg.messenger.dp.proxy import ProxyBackend, ProxyPeer
from sglang_disagg.messenger.transport import Transport, TransportPeer

BUILTIN = {"cudaipc", "libfabric", "mooncake", "nixl", "shmem"}


def members(proto: type) -> dict[str, object]:
    """The Protocol's own public members: name -> function or property."""
    return {k: v for k, v in vars(proto).items() if not k.startswith("_") and isinstance(v, (property, type(members)))}


def assigned_in_init(cls: type) -> set[str]:
    """Attributes some __init__ along the MRO sets on self (`self.x = ...`, `self.x, self.y = ...`,
    `self.x: T = ...`)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        names.add(el.attr)
    return names


def signature(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def mismatches(cls: type, proto: type) -> list[str]:
    found = []
    init_attrs = assigned_in_init(cls)
    for name, want in members(proto).items():
        if isinstance(want, property):
            if not (hasattr(cls, name) or name in init_attrs):
                found.append(f"{name}: no attribute or property")
            elif callable(inspect.getattr_static(cls, name, None)):
                found.append(f"{name}: a method, the contract has a value")
            continue
        have = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(have):
            found.append(f"{name}: no method")
        elif signature(have) != signature(want):
            found.append(f"{name}{inspect.signature(have)} differs from {name}{inspect.signature(want)}")
    return found


def backend_classes() -> dict[str, type]:
    return {name: get_backend(name) for name in list_backends()}


def test_every_builtin_backend_is_registered_and_imports_without_its_library():
    classes = backend_classes()
    assert BUILTIN <= set(classes)
    assert all(issubclass(cls, TransferBackend) for cls in classes.values())


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_backend_class_has_every_transport_member_with_its_signature(name):
    assert mismatches(get_backend(name), Transport) == []


def test_every_registered_backend_keeps_the_contract():
    assert {name: mismatches(cls, Transport) for name, cls in backend_classes().items()} == \
        {name: [] for name in backend_classes()}


def test_dp_proxy_backend_keeps_the_contract():
    assert mismatches(ProxyBackend, Transport) == []


@pytest.mark.parametrize("cls", [Peer, ProxyPeer], ids=["Peer", "ProxyPeer"])
def test_peer_classes_keep_the_peer_contract(cls):
    assert mismatches(cls, TransportPeer) == []


def test_contract_holds_what_the_messenger_calls():
    assert set(members(Transport)) == {"name", "provider", "address", "instance", "register", "connect", "recv",
                                       "write_pages", "expect", "retire", "forget", "is_retired", "landed", "stats",
                                       "close"}
    assert set(members(TransportPeer)) == {"id", "address", "state", "send", "add_remote_region", "close"}


def _double(proto: type, leave_out: str | None) -> object:
    attrs: dict[str, object] = {}
    for name, m in members(proto).items():
        if name != leave_out:
            attrs[name] = "x" if isinstance(m, property) else (lambda self, *a, **k: None)
    return type(f"Double{proto.__name__}", (), attrs)()


@pytest.mark.parametrize("proto", [Transport, TransportPeer], ids=["Transport", "TransportPeer"])
def test_a_double_missing_any_member_is_refused(proto):
    assert isinstance(_double(proto, None), proto)
    for name in members(proto):
        assert not isinstance(_double(proto, name), proto), f"a double without {name} passed"


def test_a_live_shmem_backend_and_its_peer_satisfy_the_contract():
    secret = secrets.token_bytes(32)
    a = create_backend("shmem", BackendConfig(host="127.0.0.1", port=0, secret=secret))
    b = create_backend("shmem", BackendConfig(host="127.0.0.1", port=0, secret=secret))
    try:
        assert isinstance(a, Transport) and isinstance(b, Transport)
        peer = a.connect(b.address, 10.0)
        assert isinstance(peer, TransportPeer)
        assert isinstance(b.wait_peer(10.0), TransportPeer)
    finally:
        a.close()
        b.close()
