"""The decode fast path (issue 20): a call whose plan (given, or found by its index values)
already saw its signature runs the launch kept with the plan (`eager.run`,
`cpu_backend.Launch`) instead of validating again. Each test names the backend it checks: the
fast path is the cpu backend's. What it must keep: every result of the full path, every
refusal (the values and addresses checked per call: log-decay signs, a slab that an input
shares), calls from several threads at once, and a new signature validated anew.
"""

import concurrent.futures

import pytest
import torch

import deltarule
from deltarule import ContractError, arguments, cases, eager, engine
from deltarule.tools.check import expected

from conftest import CPU, rel, small_case

pytestmark = pytest.mark.parametrize("backend", [CPU])

SLOTS = 6


def slab_call(B=2, T=1, **over):
    """A decode call on a slab of SLOTS rows (rows 4 and 1, ...), and its plan."""
    args = cases.make_inputs(small_case(B=B, T=T, initial_state=False, **over))
    args["initial_state"] = torch.randn(SLOTS, args["v"].shape[2], args["q"].shape[3], args["v"].shape[3])
    rows = torch.tensor([4, 1, 3, 0][:B])
    plan = deltarule.plan_batch(B, T, state_indices=rows, num_slots=SLOTS)
    return args, rows, plan


def launches(plan) -> int:
    return sum(hasattr(x, "recurrence") for x in plan._cache.values())


def test_kept_launch_gives_the_full_paths_results(backend):
    args, rows, plan = slab_call()
    want_o, want_slab = expected({**args, "state_indices": rows})
    for layer in range(3):                             # the first call validates, the others reuse
        slab = args["initial_state"].clone()
        o, state = deltarule.linear_attention(**{**args, "initial_state": slab}, plan=plan, backend=backend)
        assert state is slab and rel(o, want_o) < 1e-5 and rel(slab, want_slab) < 1e-5
    assert launches(plan) == 1


@pytest.mark.parametrize("over", [
    dict(decay="gk", update="erase_write"), dict(raw_gate=True, beta_sigmoid=True, qk_l2norm=True),
    dict(Hq=4, Hk=2, Hv=2), dict(Hq=2, Hk=2, Hv=4, decay="g+gk"),
], ids=["gdn2", "raw-sigmoid-l2norm", "gqa", "gva"])
def test_in_kernel_gates_match_the_reference(over, backend):
    """The kernel takes the raw-gate arm, the gates' sigmoid and qk_l2norm itself."""
    args, rows, plan = slab_call(**over)
    want_o, want_slab = expected({**args, "state_indices": rows})
    for _ in range(2):
        slab = args["initial_state"].clone()
        o, _ = deltarule.linear_attention(**{**args, "initial_state": slab}, plan=plan, backend=backend)
        assert rel(o, want_o) < 1e-5 and rel(slab, want_slab) < 1e-5


def test_index_tensors_find_their_plan(backend):
    """Without plan=, the same index values reuse one plan (and its launch)."""
    engine._PLANS.clear()                  # (other tests' calls leave their plans there)
    args, rows, _ = slab_call()
    for _ in range(3):
        deltarule.linear_attention(**{**args, "initial_state": args["initial_state"].clone()},
                                   state_indices=rows.clone(), backend=backend)
    found = [p for p in engine._PLANS.values() if p.B == 2 and p.num_slots == SLOTS and p.spans[0].read == 4]
    assert len(found) == 1 and launches(found[0]) == 1


def test_refusals_hold_after_the_signature_is_kept(backend):
    """What a signature does not fix is checked on every call: a positive log decay, a slab an
    input shares; the slab keeps every bit."""
    args, _, plan = slab_call()
    deltarule.linear_attention(**{**args, "initial_state": args["initial_state"].clone()}, plan=plan)
    slab = args["initial_state"].clone()
    before = slab.clone()
    bad_g = args["g"].clone()
    bad_g[1, 0, 1] = 0.25
    with pytest.raises(ContractError, match=r"^g: .*<= 0.*g\[1, 0, 1\] = 0\.25"):
        deltarule.linear_attention(**{**args, "g": bad_g, "initial_state": slab}, plan=plan, backend=backend)
    q_in_slab = slab[5].reshape(-1)[:args["q"].numel()].view(args["q"].shape)
    with pytest.raises(ContractError, match=r"^initial_state: .*no input shares.*q shares"):
        deltarule.linear_attention(**{**args, "q": q_in_slab, "initial_state": slab}, plan=plan, backend=backend)
    assert torch.equal(slab, before)
    assert launches(plan) == 1


def test_a_new_signature_is_validated(backend):
    """Another dtype, shape or scalar is a new signature: validated (here: refused) anew."""
    args, _, plan = slab_call()
    deltarule.linear_attention(**{**args, "initial_state": args["initial_state"].clone()}, plan=plan)
    with pytest.raises(ContractError, match=r"^k, v: "):
        deltarule.linear_attention(**{**args, "k": args["k"].half(), "initial_state": args["initial_state"]},
                                   plan=plan, backend=backend)
    with pytest.raises(ContractError, match=r"^scale: "):
        deltarule.linear_attention(**args, scale=float("nan"), plan=plan, backend=backend)
    with pytest.raises(ContractError, match=r"^plan: "):
        deltarule.linear_attention(**{**args, "q": args["q"][:1], "k": args["k"][:1], "v": args["v"][:1],
                                      "g": args["g"][:1], "beta": args["beta"][:1]}, plan=plan, backend=backend)


# a valid scalar, then one equal to it (same hash) of a type validation refuses
EQUAL_BUT_INVALID = {
    "scale-True-after-1": ("scale", 1, True),
    "scale-False-after-0": ("scale", 0, False),
    "qk_l2norm-0-after-False": ("qk_l2norm", False, 0),
    "qk_l2norm-1-after-True": ("qk_l2norm", True, 1),
    "beta_sigmoid-0-after-False": ("beta_sigmoid", False, 0),
    "beta_sigmoid-1.0-after-True": ("beta_sigmoid", True, 1.0),
    "chunk_size-True-after-1": ("chunk_size", 1, True),
    "l2norm_eps-False-after-0": ("l2norm_eps", 0, False),
    "l2norm_eps-False-after-0.0": ("l2norm_eps", 0.0, False),
}


@pytest.mark.parametrize("with_plan", [True, False], ids=["plan", "index-tensors"])
@pytest.mark.parametrize("name, valid, invalid", EQUAL_BUT_INVALID.values(), ids=EQUAL_BUT_INVALID.keys())
def test_a_kept_signature_refuses_what_a_fresh_plan_refuses(name, valid, invalid, with_plan, backend):
    """True == 1 and 0 == False: a kept launch's key holds each scalar's type, so a scalar that
    equals a kept one but is refused by validation is refused on the fast path too (with a
    plan, and without one: the call finds its plan among the last 64), the slab bit-identical."""
    args, rows, plan = slab_call()
    index = dict(plan=plan) if with_plan else dict(state_indices=rows)
    for _ in range(2):                                 # the signature kept
        deltarule.linear_attention(**{**args, "initial_state": args["initial_state"].clone()}, **index,
                                   **{name: valid}, backend=backend)
    slab = args["initial_state"].clone()
    before = slab.clone()
    with pytest.raises(ContractError) as info:
        deltarule.linear_attention(**{**args, "initial_state": slab}, **index, **{name: invalid}, backend=backend)
    assert info.value.argument == name
    assert torch.equal(slab, before), "a refused call modified the slab"
    fresh = deltarule.plan_batch(2, 1, state_indices=rows, num_slots=SLOTS)
    with pytest.raises(ContractError) as info:                       # what a fresh plan says
        deltarule.linear_attention(**{**args, "initial_state": slab}, plan=fresh, **{name: invalid}, backend=backend)
    assert info.value.argument == name


def test_inputs_that_need_grad_take_the_full_path(backend):
    args = cases.make_inputs(small_case(B=2, T=3))
    plan = deltarule.plan_batch(2, 3)
    q = args["q"].clone().requires_grad_(True)
    deltarule.linear_attention(**args, plan=plan, backend=backend)          # a kept launch
    o, state = deltarule.linear_attention(**{**args, "q": q}, plan=plan, backend=backend)
    assert o.grad_fn is not None
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_concurrent_calls_on_one_launch(backend, monkeypatch):
    """Python threads calling one kept launch at once (the kernel releases the GIL: a call that
    finds the packed problem in use packs its own copy) all compute the right thing."""
    from deltarule.backends import cpu_backend

    monkeypatch.setattr(cpu_backend, "ELEMENT_STEPS_PER_THREAD", 1)
    args = cases.make_inputs(small_case(B=4, T=1, K=32, V=64))
    plan = deltarule.plan_batch(4, 1)
    want_o, want_s = expected(args)
    deltarule.linear_attention(**args, plan=plan, backend=backend)

    def call(_):
        return deltarule.linear_attention(**args, plan=plan, backend=backend)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, range(64)))
    for o, state in results:
        assert rel(o, want_o) < 1e-5 and rel(state, want_s) < 1e-5
    assert launches(plan) == 1


def _changed_tensor(x: torch.Tensor, state: bool) -> dict:
    """Tensors that differ from x in one property a launch is kept for."""
    other_dtype = torch.float16 if x.dtype != torch.float16 else torch.float32
    strided = torch.stack([x, x], -1)[..., 0]             # x's shape and values, other strides
    changed = {"dtype": x.to(other_dtype), "shape": torch.cat([x, x], 0), "device": x.to("meta"),
               "grad": x.detach().clone().requires_grad_(True), "absent": None}
    changed["strides" if state else "contiguity"] = strided
    return changed


def _changed_scalar(x) -> dict:
    """Values that differ from x in one property: its value, or its type at an equal value."""
    if isinstance(x, str):
        return {"value": x + "-other"}
    if x is None:
        return {"value": 0.5}
    if isinstance(x, bool):
        return {"value": not x, "type": int(x)}
    if isinstance(x, int):
        return {"value": x + 1, "type": float(x)}
    return {"value": x * 2 + 1, "type": int(x) if x == int(x) else None}


class _Key(Exception):
    """The key `eager.run` computed for a call, raised by `_KeyProbe`."""


class _KeyProbe:
    """A plan stand-in that keeps no launch: `eager.run` asks it to make one, and it raises the
    key it was asked under."""
    _cache: dict = {}

    def cached(self, key, build):
        raise _Key(key)


def launch_key(call: dict):
    """The key `eager.run` looks `call`'s launch up under (the call with any plan)."""
    with pytest.raises(_Key) as found:
        eager.run_call({**call, "plan": _KeyProbe()})
    return found.value.args[0]


def test_each_validated_property_keys_its_own_launch(backend):
    """The key a plan keeps a launch under (computed by `eager.run`, generated from
    `deltarule.arguments`) changes with every property validation checks that values and
    addresses do not decide, taken in turn for every argument of the record: each tensor's
    presence, shape, contiguity (a slab: strides), dtype, device and whether it needs grad,
    and each scalar's value and type. A key that missed one would run a stale launch: a
    silent wrong answer."""
    args, _, plan = slab_call(decay="g+gk", raw_gate=True)
    base = {n: a.default for n, a in arguments.BY_NAME.items() if a.kind != "tensor"}
    base.update(args, plan=plan, scale=0.25, backend=backend)
    key = launch_key(base)
    tried = set()
    with torch.enable_grad():
        for a in arguments.ARGUMENTS:
            if a.kind in ("index?", "plan?", "capture?"):    # a kept launch is only for calls without them
                continue
            x = base[a.name]
            if a.tensor:
                changes = _changed_tensor(x, a.kind == "state?") if x is not None else {"present": base["q"]}
                if a.kind == "tensor":
                    del changes["absent"]
                if not a.differentiable:
                    del changes["grad"]
            else:
                changes = _changed_scalar(x)
            for prop, y in changes.items():
                if y is None and prop != "absent":
                    continue
                assert launch_key({**base, a.name: y}) != key, f"{a.name}: {prop}"
                tried.add(a.name)
    assert tried == {a.name for a in arguments.ARGUMENTS if a.kind not in ("index?", "plan?", "capture?")}
    assert launch_key(dict(base)) == key            # and it is a key: equal calls, equal keys


def test_a_changed_property_runs_a_launch_of_its_own(backend):
    """End to end: a plan that kept a launch, then calls differing in one property each (dtype,
    contiguity, a scalar), give the full path's results and each keep a launch of their own."""
    args, rows, plan = slab_call()
    variants = {"base": {}, "dtype": {n: args[n].to(torch.bfloat16) for n in ("q", "k", "v")},
                "contiguity": {"q": torch.stack([args["q"]] * 2, -1)[..., 0]}, "scale": {"scale": 0.5},
                "qk_l2norm": {"qk_l2norm": True}}
    for n, (name, over) in enumerate(variants.items()):
        call = {**args, **over}
        want_o, want_slab = expected({**call, "state_indices": rows})
        slab = args["initial_state"].clone()
        o, _ = deltarule.linear_attention(**{**call, "initial_state": slab}, plan=plan, backend=backend)
        tol = 2e-2 if name == "dtype" else 1e-5
        assert rel(o, want_o) < tol and rel(slab, want_slab) < tol, name
        assert launches(plan) == n + 1, name
