//! The GPU suite builds, and on a machine without a GPU says so with its own exit code instead
//! of passing; with a GPU it runs a quick pass.

#[test]
fn gpu_suite_reports_no_gpu_or_passes() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_comm-gpu-suite"))
        .args(["--quick", "--ranks", "1,2", "--max-mib", "16"])
        .output()
        .expect("run comm-gpu-suite");
    let text = String::from_utf8_lossy(&out.stdout);
    if comm::testing::cuda::device_count() == 0 {
        assert_eq!(
            out.status.code(),
            Some(77),
            "without a GPU the suite must exit 77:\n{text}"
        );
        assert!(
            text.contains("no GPU") && text.contains("nothing was tested"),
            "{text}"
        );
        assert!(!text.contains("PASS"), "{text}");
    } else {
        assert!(
            out.status.success(),
            "GPU suite failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("PASS 2 processes"), "{text}");
    }
}
