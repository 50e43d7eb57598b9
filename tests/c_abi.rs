//! The C ABI seen from C: the generated header is fresh and compiles as C99 and C++17 (with and
//! without CUDA's headers first), agrees with NVIDIA's nccl.h value for value and offset for
//! offset, libcomm.so exports every function NVIDIA's header declares, and C programs built
//! against either header run across 4 processes.
//!
//! Needs `libcomm.so` built for the same profile (`cargo build [--release]`), NVIDIA's headers
//! in COMM_TEST_NVIDIA_NCCL_INCLUDE and CUDA's in COMM_TEST_CUDA_INCLUDE (scripts/test.sh
//! installs both); a missing prerequisite fails the test and says how to get it.

mod common;

use common::{lib_dir, libcomm, root};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn required_dir(var: &str) -> PathBuf {
    let v = std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set; scripts/test.sh sets it after installing the headers it names")
    });
    let p = PathBuf::from(v);
    assert!(p.is_dir(), "{var}={} is not a directory", p.display());
    p
}

fn nvidia_include() -> PathBuf {
    let p = required_dir("COMM_TEST_NVIDIA_NCCL_INCLUDE");
    assert!(p.join("nccl.h").exists(), "no nccl.h in {}", p.display());
    p
}

fn cuda_include() -> PathBuf {
    let p = required_dir("COMM_TEST_CUDA_INCLUDE");
    assert!(
        p.join("cuda_runtime.h").exists(),
        "no cuda_runtime.h in {}",
        p.display()
    );
    p
}

fn scratch(name: &str) -> PathBuf {
    let d = lib_dir().join("c-abi-tests");
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Compiles a C (or C++) source into an executable linked against libcomm.so. `system`
/// directories (CUDA's) are searched with -isystem: their own code is not ours to lint.
fn build(src: &Path, out: &str, includes: &[PathBuf], system: &[PathBuf], cxx: bool) -> PathBuf {
    let exe = scratch(out);
    let mut cmd = Command::new(if cxx { "g++" } else { "gcc" });
    if cxx {
        cmd.args(["-std=c++17", "-x", "c++"]);
    } else {
        cmd.arg("-std=c99");
    }
    cmd.args(["-Wall", "-Wextra", "-Werror", "-O1"]);
    for i in includes {
        cmd.arg(format!("-I{}", i.display()));
    }
    for i in system {
        cmd.arg("-isystem").arg(i);
    }
    let dir = libcomm().parent().unwrap().to_path_buf();
    cmd.arg(src)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", dir.display()))
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .arg("-lcomm");
    run(&mut cmd);
    exe
}

#[test]
fn header_is_fresh() {
    let config = cbindgen::Config::from_file(root().join("cbindgen.toml")).unwrap();
    let generated = cbindgen::Builder::new()
        .with_crate(root())
        .with_config(config)
        .generate()
        .expect("cbindgen failed");
    let mut bytes = Vec::new();
    generated.write(&mut bytes);
    let path = root().join("include/nccl.h");
    if std::env::var("COMM_BLESS_HEADER").is_ok() {
        std::fs::write(&path, &bytes).unwrap();
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == bytes,
        "include/nccl.h is stale: regenerate it with `COMM_BLESS_HEADER=1 cargo test --test c_abi header_is_fresh` (or cbindgen --config cbindgen.toml --output include/nccl.h) and commit it"
    );
}

#[test]
fn header_compiles_as_c99_and_cxx17_with_and_without_cuda() {
    let ours = root().join("include");
    let cuda = cuda_include();
    for (with_cuda, cxx) in [(false, false), (false, true), (true, false), (true, true)] {
        let src = scratch(&format!("hdr_{with_cuda}_{cxx}.c"));
        let prelude = if with_cuda {
            "#include <cuda_runtime.h>\n"
        } else {
            ""
        };
        std::fs::write(
            &src,
            format!(
                "{prelude}#include <nccl.h>\nint main(void) {{ ncclComm_t c = NCCL_COMM_NULL; cudaStream_t s = 0; ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER; (void)c; (void)s; return cfg.blocking == NCCL_CONFIG_UNDEF_INT ? 0 : 1; }}\n"
            ),
        )
        .unwrap();
        let mut cmd = Command::new(if cxx { "g++" } else { "gcc" });
        if cxx {
            cmd.args(["-std=c++17", "-x", "c++"]);
        } else {
            cmd.args(["-std=c99"]);
        }
        cmd.args(["-pedantic", "-Wall", "-Wextra", "-Werror", "-fsyntax-only"])
            .arg(format!("-I{}", ours.display()));
        if with_cuda {
            cmd.arg("-isystem").arg(&cuda);
        }
        cmd.arg(&src);
        run(&mut cmd);
    }
}

/// Runs abi_dump.c against a header and returns what it printed.
fn abi_dump(includes: &[PathBuf], system: &[PathBuf], name: &str) -> String {
    let exe = build(
        &root().join("tests/c/abi_dump.c"),
        name,
        includes,
        system,
        false,
    );
    run(&mut Command::new(exe))
}

#[test]
fn abi_matches_nvidia_header() {
    let ours = abi_dump(&[root().join("include")], &[], "abi_ours");
    let theirs = abi_dump(&[nvidia_include()], &[cuda_include()], "abi_nvidia");
    let (a, b): (Vec<&str>, Vec<&str>) = (ours.lines().collect(), theirs.lines().collect());
    assert!(a.len() >= 100, "abi dump printed only {} lines", a.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x, y, "comm's nccl.h and NVIDIA's disagree");
    }
    assert_eq!(a.len(), b.len());
}

/// Function names a header declares (`name(` after a return type).
fn declared_functions(header: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(header).unwrap();
    let mut names = Vec::new();
    for line in text.lines() {
        let l = line.trim_start();
        if !(l.starts_with("ncclResult_t") || l.starts_with("const char*") || l.starts_with("void"))
        {
            continue;
        }
        if let Some(open) = l.find('(') {
            let name = l[..open]
                .split_whitespace()
                .last()
                .unwrap_or("")
                .trim_start_matches('*');
            if name.starts_with("nccl") || name.starts_with("pnccl") {
                names.push(name.to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

fn exported() -> Vec<String> {
    let out = run(Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(libcomm()));
    out.lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_function_of_nvidias_header_and_torchs_imports_is_exported() {
    let ours = exported();
    let wanted = declared_functions(&nvidia_include().join("nccl.h"));
    assert!(
        wanted.len() > 120,
        "found only {} declarations in NVIDIA's nccl.h",
        wanted.len()
    );
    let missing: Vec<&String> = wanted.iter().filter(|n| !ours.contains(n)).collect();
    assert!(missing.is_empty(), "libcomm.so does not export {missing:?}");
    let torch = std::fs::read_to_string(root().join("tests/data/torch_nccl_symbols.txt")).unwrap();
    let missing: Vec<&str> = torch
        .lines()
        .map(str::trim)
        .filter(|n| !n.is_empty() && !ours.iter().any(|o| o == n))
        .collect();
    assert!(
        missing.is_empty(),
        "libcomm.so does not export what PyTorch imports: {missing:?}"
    );
    // And nothing of the library's internals leaks out.
    let stray: Vec<&String> = ours
        .iter()
        .filter(|n| !(n.starts_with("nccl") || n.starts_with("pnccl") || n.starts_with("comm")))
        .collect();
    assert!(stray.is_empty(), "libcomm.so exports internals: {stray:?}");
    // Every function of our own header too.
    let own = declared_functions(&root().join("include/nccl.h"));
    let missing: Vec<&String> = own.iter().filter(|n| !ours.contains(n)).collect();
    assert!(
        missing.is_empty(),
        "declared in include/nccl.h but not exported: {missing:?}"
    );
}

fn run_c_program(exe: PathBuf, n: usize) {
    let id = common::id_to_hex(&common::unique_id());
    let children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .env("COMM_TEST_RANK", r.to_string())
                .env("COMM_TEST_NRANKS", n.to_string())
                .env("COMM_TEST_ID", &id)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut children = children;
    loop {
        if children.iter_mut().all(|c| c.try_wait().unwrap().is_some()) {
            break;
        }
        if std::time::Instant::now() > deadline {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            panic!("the C program did not finish in time");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("all checks passed"),
            "rank {r} failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn c_program_against_comms_header_runs_on_4_processes() {
    let exe = build(
        &root().join("tests/c/allreduce_ranks.c"),
        "ranks_ours",
        &[root().join("include")],
        &[],
        false,
    );
    run_c_program(exe, 4);
}

#[test]
fn c_program_against_nvidias_header_runs_on_4_processes() {
    let exe = build(
        &root().join("tests/c/allreduce_ranks.c"),
        "ranks_nvidia",
        &[nvidia_include()],
        &[cuda_include()],
        false,
    );
    run_c_program(exe, 4);
}

#[test]
fn cxx_program_against_comms_header_runs_on_3_processes() {
    let exe = build(
        &root().join("tests/c/allreduce_ranks.c"),
        "ranks_cxx",
        &[root().join("include")],
        &[],
        true,
    );
    run_c_program(exe, 3);
}
