"""The C kernels' problem structs (csrc/recurrent.c `problem`, csrc/backward.c `bproblem`,
csrc/conv.c `conv_problem`) as field tables, the one place their Python side is written.

A `Layout` generates the native-aligned `struct.Struct` from its table and packs by field
name, so a value cannot land in its neighbour's field. Each C file exports the compiler's
table of the same struct (csrc/fields.h: name, offset, size; the end carries sizeof);
`Layout.check` compares the two field by field when the library loads, so a field moved,
added, removed or retyped on one side only is an ImportError naming it.

>>> layout = Layout("demo", (("p", "P"), ("n", "q"), ("flag", "i"), ("pair", "f", 2)))
>>> layout.struct.format, layout.offset("flag"), layout.size
('@Pqi2f', 16, 32)
>>> len(layout.pack(p=0, n=3, flag=1, pair=(0.5, 2.0)))
32
"""

from __future__ import annotations

import ctypes
import struct


class Layout:
    """A C struct as (name, struct code[, count]) fields in declaration order."""

    def __init__(self, name: str, fields: tuple[tuple, ...]):
        self.name = name
        self._fields = tuple((f[0], f[1], f[2] if len(f) > 2 else 1) for f in fields)
        codes = "".join(code if count == 1 else f"{count}{code}" for _, code, count in self._fields)
        # "0q" pads the end as C does (its strictest member is 8-byte aligned in every struct here)
        self.struct = struct.Struct("@" + codes)
        self.size = struct.calcsize("@" + codes + "0q")
        self._offsets, prefix = {}, "@"
        for field_name, code, count in self._fields:
            self._offsets[field_name] = (struct.calcsize(prefix + "0" + code), count * struct.calcsize(code))
            prefix += code if count == 1 else f"{count}{code}"

    def offset(self, field_name: str) -> int:
        return self._offsets[field_name][0]

    def pack(self, **values) -> bytearray:
        """The struct's bytes (`size`) with every field given by name (arrays as sequences); a missing or
        unknown name is a TypeError."""
        if values.keys() != self._offsets.keys():
            raise TypeError(f"{self.name}: fields {sorted(self._offsets.keys() - values.keys())} missing, "
                            f"{sorted(values.keys() - self._offsets.keys())} unknown")
        flat = []
        for field_name, _, count in self._fields:
            if count == 1:
                flat.append(values[field_name])
            else:
                flat.extend(values[field_name])
        return bytearray(self.struct.pack(*flat)).ljust(self.size, b"\0")     # C's trailing padding too

    def leading(self, *names: str) -> struct.Struct:
        """A struct of the first fields, which must be these (a run repacks just them)."""
        if tuple(f[0] for f in self._fields[:len(names)]) != names:
            raise ValueError(f"{self.name}: {names} are not its first fields")
        return struct.Struct("@" + "".join(f[1] if f[2] == 1 else f"{f[2]}{f[1]}" for f in self._fields[:len(names)]))

    def check(self, exported) -> None:
        """Compare with the C side's table (`exported`: a ctypes function returning `field *`)."""
        exported.restype = ctypes.POINTER(_Field)
        table, found, i = exported(), {}, 0
        while table[i].name is not None:
            found[table[i].name.decode()] = (table[i].offset, table[i].size)
            i += 1
        c_size = table[i].size
        problems = [f"{n}: C {found.get(n)}, Python {self._offsets[n]} (offset, size)"
                    for n in self._offsets if found.get(n) != self._offsets[n]]
        problems += [f"{n}: in C only" for n in found.keys() - self._offsets.keys()]
        if c_size != self.size:
            problems.append(f"size: C {c_size}, Python {self.size}")
        if problems:
            raise ImportError(f"deltarule cpu kernel: `{self.name}` differs between the C file and the binding "
                              f"({'; '.join(problems)}); rebuild (pip install --no-build-isolation -e .) or mend "
                              "the table in deltarule/kernels/cpu/layout.py")


class _Field(ctypes.Structure):
    _fields_ = (("name", ctypes.c_char_p), ("offset", ctypes.c_size_t), ("size", ctypes.c_size_t))


def _fields(names: str, code: str) -> tuple[tuple, ...]:
    return tuple((n, code) for n in names.split())


# csrc/recurrent.c's `problem`
PROBLEM = Layout("problem", (
    *_fields("q k v g gk b w a_log dt_bias s0 s o bad spans token_rows owner u_out capture", "P"),
    *_fields("N T Hv K V G rq rk token_cols tokens checkpoint capacity", "q"),
    ("s0_stride", "q", 4), ("s_stride", "q", 4), ("slab_bytes", "q"), ("operand_bytes", "q", 9),
    *_fields("b_form w_form qk_type v_type g_type gk_type b_type w_type s0_type s_type a_type dtb_type raw_gate "
             "gate_sigmoid check_decay stream_state prefetch_next qk_l2norm", "i"),
    ("l2norm_eps", "f"), ("scale", "f"),
))

# csrc/backward.c's `bproblem`
BACKWARD = Layout("bproblem", (
    *_fields("q k v u g gk b w ck ds dout spans dq dk dv dlam db dw ds0", "P"),
    *_fields("N T Hv K V G rq rk chunk", "q"),
    ("b_form", "i"), ("w_form", "i"), ("scale", "f"),
))

MAX_PARTS = 4        # csrc/conv.c's MAX_PARTS

# csrc/conv.c's `conv_problem`
CONV = Layout("conv_problem", (
    *_fields("x out wt bias state seq", "P"),
    *_fields("x_row s_slot s_col s_chan N C W", "q"),
    *_fields("x_type s_type rolling silu gather parts", "i"),
    ("cut", "q", MAX_PARTS + 1), ("part_base", "q", MAX_PARTS),
))
