"""comm_torch._lib mirrors part of include/nccl.h by hand (ctypes cannot read a header): result
codes, reduction ops, datatypes, #defines, ncclConfig_t, ncclUniqueId and the prototypes of
the functions it calls. These tests read the checked-in header and compare every mirrored value
with its declaration, so a change on either side fails here instead of in a collective."""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from comm_torch import _lib

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HEADER = os.path.join(REPO, "include", "nccl.h")

# _lib's name -> the header's name of the same value (an enum member or a #define).
MIRRORED = {
    "SUCCESS": "ncclSuccess",
    "IN_PROGRESS": "ncclInProgress",
    "OP_SUM": "ncclSum",
    "OP_PROD": "ncclProd",
    "OP_MAX": "ncclMax",
    "OP_MIN": "ncclMin",
    "OP_AVG": "ncclAvg",
    "OP_BAND": "COMM_OP_BAND",
    "OP_BOR": "COMM_OP_BOR",
    "OP_BXOR": "COMM_OP_BXOR",
    "INT8": "ncclInt8",
    "UINT8": "ncclUint8",
    "INT32": "ncclInt32",
    "UINT32": "ncclUint32",
    "INT64": "ncclInt64",
    "UINT64": "ncclUint64",
    "FLOAT16": "ncclFloat16",
    "FLOAT32": "ncclFloat32",
    "FLOAT64": "ncclFloat64",
    "BFLOAT16": "ncclBfloat16",
    "FLOAT8E4M3": "ncclFloat8e4m3",
    "FLOAT8E5M2": "ncclFloat8e5m2",
    "SPLIT_NOCOLOR": "NCCL_SPLIT_NOCOLOR",
    "SCALAR_DEVICE": "ncclScalarDevice",
    "SCALAR_HOST_IMMEDIATE": "ncclScalarHostImmediate",
    "FEATURE_DEVICE_MEMORY": "COMM_FEATURE_DEVICE_MEMORY",
    "FEATURE_WINDOWS": "COMM_FEATURE_WINDOWS",
    "UNIQUE_ID_BYTES": "NCCL_UNIQUE_ID_BYTES",
    "_CONFIG_UNDEF_INT": "NCCL_CONFIG_UNDEF_INT",
    "_API_MAGIC": "NCCL_API_MAGIC",
    "_VERSION_CODE": "NCCL_VERSION_CODE",
}

# C's INT_MIN for this platform's int, the one value from limits.h the header uses.
_INT_MIN = -(2 ** (8 * ctypes.sizeof(ctypes.c_int) - 1))


def _source():
    with open(HEADER) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


SOURCE = _source()


def _integer(token):
    token = token.strip()
    if token == "INT_MIN":
        return _INT_MIN
    return int(token, 0)


def defines():
    """#define NAME value, for every value that is an integer literal (or INT_MIN)."""
    out = {}
    for name, value in re.findall(r"^#define\s+(\w+)[ \t]+(\S[^\n]*?)\s*$", SOURCE, re.MULTILINE):
        try:
            out[name] = _integer(value)
        except ValueError:
            pass  # a macro with arguments, a string, an expression: nothing _lib mirrors
    return out


def enums():
    """typedef enum {...} name: {name: {member: value}}."""
    out = {}
    for body, name in re.findall(r"typedef\s+enum\s*\{(.*?)\}\s*(\w+)\s*;", SOURCE, re.DOTALL):
        members = {}
        for item in body.split(","):
            if item.strip():
                member, value = item.split("=")
                members[member.strip()] = _integer(value)
        out[name] = members
    return out


def _c_type(decl):
    """'const char *netName' -> ('const char *', 'netName'); arrays keep their bound."""
    decl = " ".join(decl.replace("*", " * ").split())
    m = re.fullmatch(r"(.*?)\s*(\w+)\s*(\[\s*(\w+)\s*\])?", decl)
    assert m, f"cannot read the declaration {decl!r}"
    return m.group(1).replace(" *", "*").replace("*", " *").strip(), m.group(2), m.group(4)


def struct(name):
    """The fields of typedef struct {...} name, as (C type, field, array bound or None)."""
    m = re.search(r"typedef\s+struct\s*\{([^{}]*)\}\s*" + name + r"\s*;", SOURCE)
    assert m, f"no typedef struct {name} in {HEADER}"
    return [_c_type(field) for field in m.group(1).split(";") if field.strip()]


def prototypes():
    """Every function declaration: {name: (return C type, [parameter C types])}."""
    out = {}
    for ret, name, params in re.findall(r"^([A-Za-z_][\w \t]*?[\s*])(\w+)\(([^)]*)\);", SOURCE, re.MULTILINE):
        params = params.strip()
        types = [] if params in ("", "void") else [_c_type(p)[0] for p in params.split(",")]
        out[name] = (" ".join(ret.replace("*", " *").split()), types)
    return out


DEFINES, ENUMS = defines(), enums()


def header_value(name):
    if name in DEFINES:
        return DEFINES[name]
    found = [members[name] for members in ENUMS.values() if name in members]
    assert len(found) == 1, f"{name} is not an integer #define or enum member of {HEADER}"
    return found[0]


def test_the_header_is_read():
    # A parser that found nothing would make every comparison below vacuous.
    assert len(DEFINES) > 20 and len(ENUMS) >= 4 and len(prototypes()) > 50
    assert ENUMS["ncclDataType_t"]["ncclFloat32"] == 7 and DEFINES["NCCL_API_MAGIC"] == 0xCAFEBEEF


@pytest.mark.parametrize("ours, theirs", sorted(MIRRORED.items()))
def test_mirrored_value(ours, theirs):
    assert getattr(_lib, ours) == header_value(theirs), f"_lib.{ours} differs from {theirs} in include/nccl.h"


@pytest.mark.parametrize("enum", ["ncclDataType_t", "ncclScalarResidence_t"])
def test_whole_enum_is_mirrored(enum):
    # Counters such as ncclNumTypes are no values a caller passes.
    members = {m for m in ENUMS[enum] if not m.startswith("ncclNum")}
    missing = members - set(MIRRORED.values())
    assert not missing, f"{enum} members {sorted(missing)} have no constant in comm_torch._lib"


@pytest.mark.parametrize("prefix", ["COMM_OP_", "COMM_FEATURE_"])
def test_every_comm_extension_is_mirrored(prefix):
    missing = {d for d in DEFINES if d.startswith(prefix)} - set(MIRRORED.values())
    assert not missing, f"{sorted(missing)} have no constant in comm_torch._lib"


def test_result_names():
    results = {value: member for member, value in ENUMS["ncclResult_t"].items() if member != "ncclNumResults"}
    assert _lib.RESULT_NAMES == results


# The C types _lib's structures and prototypes use, and what each is in ctypes. Enums are int.
_SCALARS = {
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "size_t": ctypes.c_size_t,
    "double": ctypes.c_double,
    "char": ctypes.c_char,
    "ncclResult_t": ctypes.c_int,
    "ncclDataType_t": ctypes.c_int,
    "ncclRedOp_t": ctypes.c_int,
    "ncclScalarResidence_t": ctypes.c_int,
    "ncclComm_t": ctypes.c_void_p,
    "cudaStream_t": ctypes.c_void_p,
    "uint64_t": ctypes.c_uint64,
    "ncclWindow_t": ctypes.c_void_p,
    "ncclWaitSignalDesc_t": _lib.WaitSignalDesc,
    "ncclUniqueId": _lib.UniqueId,
    "ncclConfig_t": _lib.Config,
}


def as_ctypes(c_type):
    """The ctypes type that passes a value of ``c_type`` (const does not matter to ctypes)."""
    bare = " ".join(w for w in c_type.split() if w != "const")
    if bare in ("void *", "char *"):
        return ctypes.c_void_p if bare == "void *" else ctypes.c_char_p
    if bare.endswith(" *"):
        return ctypes.POINTER(as_ctypes(bare[:-2]))
    assert bare in _SCALARS, f"no ctypes equivalent known for the C type {c_type!r}"
    return _SCALARS[bare]


def _layout(fields):
    """A ctypes structure laid out from the header's fields alone (ctypes follows the
    platform's C alignment rules), to compare offsets and size with _lib's."""
    members = []
    for c_type, name, bound in fields:
        member = as_ctypes(c_type)
        if bound is not None:
            member = member * (DEFINES[bound] if bound in DEFINES else int(bound))
        members.append((name, member))
    return type("FromHeader", (ctypes.Structure,), {"_fields_": members})


def _same(ours, theirs):
    if ours is theirs:
        return True
    # Arrays of the same element type and length are equal types made twice.
    return (
        hasattr(ours, "_length_")
        and getattr(theirs, "_length_", None) == ours._length_
        and _same(ours._type_, theirs._type_)
    )


@pytest.mark.parametrize("struct_name, mirror", [("ncclConfig_t", _lib.Config), ("ncclUniqueId", _lib.UniqueId)])
def test_struct_layout(struct_name, mirror):
    fields = struct(struct_name)
    assert [name for _, name, _ in fields] == [name for name, _ in mirror._fields_], "field names or order differ"
    built = _layout(fields)
    for (name, ours), (_, theirs) in zip(mirror._fields_, built._fields_):
        assert _same(ours, theirs), f"{struct_name}.{name}: _lib has {ours}, the header {theirs}"
        assert getattr(mirror, name).offset == getattr(built, name).offset, f"{struct_name}.{name} moved"
    assert ctypes.sizeof(mirror) == ctypes.sizeof(built)


def test_config_new_is_the_initializer():
    """Config.new() sets what NCCL_CONFIG_INITIALIZER does, field by field."""
    m = re.search(r"#define\s+NCCL_CONFIG_INITIALIZER\s*\{(.*?)\}", SOURCE.replace("\\\n", " "), re.DOTALL)
    assert m, "no NCCL_CONFIG_INITIALIZER"
    values = [v.strip() for v in m.group(1).split(",")]
    names = [name for name, _ in _lib.Config._fields_]
    assert len(values) == len(names)
    cfg = _lib.Config.new()
    for name, value in zip(names, values):
        got = getattr(cfg, name)
        if value == "sizeof(ncclConfig_t)":
            assert got == ctypes.sizeof(_lib.Config), name
        elif value == "NCCL_CONFIG_UNDEF_PTR":
            assert got is None, name
        else:
            assert got == header_value(value), f"{name}: {got} where the initializer has {value}"


@pytest.mark.parametrize("name", sorted({**_lib._PROTOTYPES, **_lib._WINDOW_PROTOTYPES}))
def test_prototype(name):
    declared = prototypes()
    assert name in declared, f"include/nccl.h does not declare {name}"
    ret, params = declared[name]
    restype, argtypes = {**_lib._PROTOTYPES, **_lib._WINDOW_PROTOTYPES}[name]
    assert restype == as_ctypes(ret), f"{name} returns {ret}"
    assert list(argtypes) == [as_ctypes(p) for p in params], f"{name} takes ({', '.join(params)})"


def test_layout_as_a_c_compiler_sees_it(tmp_path):
    """The same sizes and offsets from the C compiler itself, for what ctypes cannot vouch for."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (scripts/deps.sh installs gcc)")
    fields = [name for name, _ in _lib.Config._fields_]
    program = tmp_path / "layout.c"
    program.write_text(
        '#include <stdio.h>\n#include <stddef.h>\n#include "nccl.h"\nint main(void) {\n'
        '  printf("sizeof %zu %zu\\n", sizeof(ncclConfig_t), sizeof(ncclUniqueId));\n'
        + "".join(f'  printf("{f} %zu\\n", offsetof(ncclConfig_t, {f}));\n' for f in fields)
        + "  return 0;\n}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", os.path.dirname(HEADER), "-o", str(exe), str(program)], check=True, timeout=120)
    out = dict(
        line.split(" ", 1)
        for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    )
    assert out.pop("sizeof").split() == [str(ctypes.sizeof(_lib.Config)), str(ctypes.sizeof(_lib.UniqueId))]
    assert {f: int(v) for f, v in out.items()} == {f: getattr(_lib.Config, f).offset for f in fields}
