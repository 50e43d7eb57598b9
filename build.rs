//! Build script: link flags for libcomm.so, and the device kernels.
//!
//! The kernels (`kernels/*.cu`) are compiled by nvcc into one fatbin (SASS for sm_80 and sm_90,
//! PTX for compute_90 so that newer GPUs can JIT it) that the library embeds and loads with
//! `cuModuleLoadData`. Where nvcc is found the build sets `cfg(comm_kernels)`; where it is not,
//! the build warns and the library is host-only. `COMM_REQUIRE_NVCC=1` makes a missing nvcc, or a
//! failing compile, a build error instead (CI sets it).
//!
//! nvcc is looked for in `NVCC`, `CUDA_HOME` / `CUDA_PATH` (`bin/nvcc`), `PATH`, and the pip
//! wheel of `cuda-toolkit[nvcc,cccl]==13.0.*` (`nvidia/cu13/bin/nvcc` under site-packages) of the
//! project's own environment (`$COMM_DEPS/venv`, by default `.deps/venv`, as scripts/deps.sh
//! makes it) or of `python3`.

use std::collections::hash_map::DefaultHasher;
use std::env;
use std::ffi::OsString;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What nvcc compiles for: SASS for the GPUs the library is tuned for, PTX for the rest.
const GENCODE: [&str; 6] = [
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90,code=sm_90",
    "-gencode",
    "arch=compute_90,code=compute_90",
];

/// Environment variables that change what this script finds or does.
const WATCHED_ENV: [&str; 7] = [
    "COMM_GIT_REVISION",
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "COMM_DEPS",
    "COMM_REQUIRE_NVCC",
    "PATH",
];

fn main() {
    // The library's calls into its own nccl* symbols must never bind to another NCCL loaded in
    // the same process (PyTorch loads its own libnccl globally).
    // No -soname here: cargo passes this script's link arguments to the link of every dependent
    // cdylib as well, and nccl/ links the same code as libnccl.so with NCCL's SONAME
    // (libnccl.so.2), which a later -soname would override. libcomm.so is loaded by path
    // (Python, dlopen) or linked as -lcomm, which records its file name; the installed tree
    // makes libcomm.so a link to libnccl.so.2.
    println!("cargo:rustc-link-arg-cdylib=-Wl,-Bsymbolic-functions");
    println!("cargo:rerun-if-changed=build.rs");

    git_revision();

    println!("cargo::rustc-check-cfg=cfg(comm_kernels)");
    println!("cargo:rerun-if-changed=kernels");
    for var in WATCHED_ENV {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let required = env::var("COMM_REQUIRE_NVCC").is_ok_and(|v| v == "1");
    let outcome = find_nvcc().and_then(|nvcc| build_kernels(&nvcc));
    match outcome {
        Ok(built) => {
            println!("cargo:rustc-cfg=comm_kernels");
            println!("cargo:rustc-env=COMM_FATBIN={}", built.fatbin.display());
            println!(
                "cargo:rustc-env=COMM_REDUCE_ARGS_LAYOUT={}",
                built.layout.display()
            );
            // For the unit test that compiles tests/cuda/reduce_math_test.cu with the same nvcc.
            println!("cargo:rustc-env=COMM_NVCC={}", built.nvcc.path.display());
            let flags = built.nvcc.extra_flags.join("\u{1f}");
            println!("cargo:rustc-env=COMM_NVCC_FLAGS={flags}");
        }
        Err(why) if required => {
            eprintln!("error: COMM_REQUIRE_NVCC=1, but the CUDA kernels cannot be built: {why}");
            std::process::exit(1);
        }
        Err(why) => {
            println!("cargo:warning=building libcomm without CUDA kernels (host memory only)");
            for line in why.lines() {
                println!("cargo:warning={line}");
            }
        }
    }
}

#[derive(Clone)]
struct Nvcc {
    path: PathBuf,
    /// Include and library directories of a toolkit laid out as the pip wheel is, which nvcc's own
    /// profile may not cover.
    extra_flags: Vec<String>,
}

struct Built {
    nvcc: Nvcc,
    fatbin: PathBuf,
    layout: PathBuf,
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
}

fn out_dir() -> PathBuf {
    PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
}

fn non_empty_env(var: &str) -> Option<OsString> {
    env::var_os(var).filter(|v| !v.is_empty())
}

fn find_nvcc() -> Result<Nvcc, String> {
    let path = locate_nvcc()?;
    let mut extra_flags = Vec::new();
    // <root>/bin/nvcc: add <root>/include (and its CCCL headers) and <root>/lib when present.
    if let Some(root) = path.parent().and_then(Path::parent) {
        let include = root.join("include");
        if include.join("cuda_runtime.h").is_file() {
            extra_flags.push(format!("-I{}", include.display()));
            if include.join("cccl").is_dir() {
                extra_flags.push("-isystem".to_string());
                extra_flags.push(include.join("cccl").display().to_string());
            }
        }
        let lib = root.join("lib");
        if lib.join("libcudart_static.a").is_file() {
            extra_flags.push(format!("-L{}", lib.display()));
        }
    }
    Ok(Nvcc { path, extra_flags })
}

fn locate_nvcc() -> Result<PathBuf, String> {
    if let Some(nvcc) = non_empty_env("NVCC") {
        let nvcc = PathBuf::from(nvcc);
        // A bare name is looked up in PATH, as a shell would.
        let found = if nvcc.components().count() == 1 {
            search_path(&nvcc)
        } else {
            Some(nvcc.clone()).filter(|p| p.is_file())
        };
        return found.ok_or_else(|| format!("NVCC={} does not exist", nvcc.display()));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = non_empty_env(var) {
            let nvcc = Path::new(&root).join("bin").join("nvcc");
            if nvcc.is_file() {
                return Ok(nvcc);
            }
        }
    }
    if let Some(nvcc) = search_path(Path::new("nvcc")) {
        return Ok(nvcc);
    }
    let deps = non_empty_env("COMM_DEPS")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join(".deps"));
    let pythons = [deps.join("venv/bin/python"), PathBuf::from("python3")];
    for python in &pythons {
        for site in site_packages(python) {
            let nvcc = site.join("nvidia/cu13/bin/nvcc");
            if nvcc.is_file() {
                return Ok(nvcc);
            }
        }
    }
    Err(format!(
        "no nvcc in NVCC, CUDA_HOME, CUDA_PATH or PATH, nor a pip cuda-toolkit under {} or python3 \
         (run scripts/deps.sh, or set NVCC)",
        deps.join("venv").display()
    ))
}

fn search_path(name: &Path) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Every site-packages directory of a Python interpreter (none if it does not run).
fn site_packages(python: &Path) -> Vec<PathBuf> {
    if python.components().count() > 1 && !python.is_file() {
        return Vec::new();
    }
    let script = "import site, sysconfig\n\
                  paths = [sysconfig.get_paths()[k] for k in ('purelib', 'platlib')]\n\
                  paths += getattr(site, 'getsitepackages', lambda: [])()\n\
                  paths.append(site.getusersitepackages())\n\
                  print('\\n'.join(paths))";
    match Command::new(python).args(["-c", script]).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// Compiles the fatbin and probes the C layout of `ReduceArgs`, unless the outputs of an earlier
/// run with the same compiler, flags and sources are still in OUT_DIR (this script reruns
/// whenever PATH changes, which must not cost a kernel compile).
fn build_kernels(nvcc: &Nvcc) -> Result<Built, String> {
    let kernels = manifest_dir().join("kernels");
    let out = out_dir();
    let fatbin = out.join("comm_kernels.fatbin");
    let layout = out.join("reduce_args_layout.rs");
    let stamp = out.join("comm_kernels.stamp");

    let mut sources: Vec<PathBuf> = fs::read_dir(&kernels)
        .map_err(|e| format!("cannot list {}: {e}", kernels.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("cu" | "cuh")))
        .collect();
    sources.sort();
    let units: Vec<&PathBuf> = sources
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    if units.is_empty() {
        return Err(format!("no .cu files in {}", kernels.display()));
    }

    // One translation unit including every .cu, so that one nvcc run makes one fatbin.
    let mut all =
        String::from("// Generated by build.rs: every kernels/*.cu, compiled as one unit.\n");
    for unit in &units {
        all.push_str(&format!("#include \"{}\"\n", c_string_body(unit)));
    }
    let all_cu = out.join("comm_kernels.cu");
    let threads = env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, 3);
    let mut args: Vec<String> = vec!["-fatbin".into()];
    args.extend(GENCODE.iter().map(|s| s.to_string()));
    args.extend(["-O3", "-std=c++17"].map(String::from));
    args.push(format!("-I{}", kernels.display()));
    args.extend(nvcc.extra_flags.iter().cloned());

    let mut hasher = DefaultHasher::new();
    nvcc.path.hash(&mut hasher);
    if let Ok(meta) = fs::metadata(&nvcc.path) {
        meta.len().hash(&mut hasher);
        meta.modified().ok().hash(&mut hasher);
    }
    args.hash(&mut hasher);
    all.hash(&mut hasher);
    for source in &sources {
        fs::read(source)
            .map_err(|e| format!("cannot read {}: {e}", source.display()))?
            .hash(&mut hasher);
    }
    let key = format!("{:016x}\n", hasher.finish());
    let fresh =
        fatbin.is_file() && layout.is_file() && fs::read_to_string(&stamp).is_ok_and(|s| s == key);
    if !fresh {
        let _ = fs::remove_file(&stamp);
        write(&all_cu, &all)?;
        let mut cmd = Command::new(&nvcc.path);
        // nvcc compiles the three targets in parallel threads.
        cmd.args(&args)
            .arg("--threads")
            .arg(threads.to_string())
            .arg("-o")
            .arg(&fatbin)
            .arg(&all_cu);
        run(&mut cmd, "compiling the kernels")?;
        probe_layout(nvcc, &kernels, &out, &layout)?;
        write(&stamp, &key)?;
    }
    Ok(Built {
        nvcc: nvcc.clone(),
        fatbin,
        layout,
    })
}

/// Compiles and runs a host program that prints the size and field offsets of the C ReduceArgs as
/// Rust constants; src/cuda/kernels.rs asserts at compile time that its mirror matches them.
fn probe_layout(nvcc: &Nvcc, kernels: &Path, out: &Path, layout: &Path) -> Result<(), String> {
    let source = out.join("reduce_args_layout.cu");
    let program = out.join("reduce_args_layout");
    let fields = [
        "dst",
        "src",
        "scale",
        "has_scale",
        "nsrc",
        "count",
        "divide_by",
        "via",
        "scale_at",
    ];
    let mut body = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"comm_kernels.cuh\"\nint main(void) {\n\
         printf(\"pub const SIZE: usize = %zu;\\n\", sizeof(ReduceArgs));\n\
         printf(\"pub const MAX_SOURCES: usize = %d;\\n\", COMM_MAX_SOURCES);\n",
    );
    for field in fields {
        body.push_str(&format!(
            "printf(\"pub const {}: usize = %zu;\\n\", offsetof(ReduceArgs, {field}));\n",
            field.to_uppercase()
        ));
    }
    body.push_str("return 0;\n}\n");
    write(&source, &body)?;
    let mut cmd = Command::new(&nvcc.path);
    cmd.arg("-std=c++17")
        .arg(format!("-I{}", kernels.display()))
        .args(&nvcc.extra_flags)
        .arg("-o")
        .arg(&program)
        .arg(&source);
    run(&mut cmd, "compiling the ReduceArgs layout probe")?;
    let output = run(
        &mut Command::new(&program),
        "running the ReduceArgs layout probe",
    )?;
    write(layout, &output)
}

/// Runs a command; its stdout on success, its stderr in the error otherwise. Warnings on stderr
/// of a successful run are passed on.
fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: cannot run {:?}: {e}", cmd.get_program()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}):\n{cmd:?}\n{stderr}",
            out.status
        ));
    }
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning={what}: {line}");
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn write(path: &Path, contents: &str) -> Result<(), String> {
    fs::write(path, contents).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// A path as the inside of a C string literal.
fn c_string_body(path: &Path) -> String {
    path.display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
}

/// `COMM_GIT_REVISION` for the library (commGetVersion, the version log line): the environment's
/// value where set (a source tarball has no .git), else the commit checked out, else "unknown".
/// The build reruns when HEAD or the branch it names moves, so a rebuilt library never names an
/// older commit.
fn git_revision() {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(manifest_dir())
            .output()
            .ok()?;
        let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
        (out.status.success() && !text.is_empty()).then_some(text)
    };
    let revision = match non_empty_env("COMM_GIT_REVISION") {
        Some(v) => v.to_string_lossy().into_owned(),
        None => {
            // The files that say which commit is checked out (a worktree keeps HEAD apart from
            // the refs).
            let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
            watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
            for name in watched {
                if let Some(path) = git(&["rev-parse", "--git-path", &name]) {
                    let path = manifest_dir().join(path);
                    if path.exists() {
                        println!("cargo:rerun-if-changed={}", path.display());
                    }
                }
            }
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_string())
        }
    };
    println!("cargo:rustc-env=COMM_GIT_REVISION={revision}");
}
