//! The lab command's refusals, end to end: each says what is wrong, and nothing is measured
//! when the run cannot be kept.

use std::process::Command;

fn lab() -> Command {
    Command::new(env!("CARGO_BIN_EXE_guestmem-lab"))
}

/// Runs `args`; returns (success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let out = lab().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn lab_zero_rounds_is_refused() {
    let (ok, err) = run(&["guards", "--rounds", "0"]);
    assert!(!ok);
    assert!(err.contains("--rounds") && err.contains('0'), "{err}");
}

#[test]
fn lab_out_under_a_missing_parent_is_refused_before_measuring_and_creates_nothing() {
    let top = std::env::temp_dir().join(format!("guestmem-lab-out-{}", std::process::id()));
    let out = top.join("dir").join("x");
    // Default rounds: measuring would take seconds and print a table; the refusal comes first.
    let o = lab()
        .args(["guards", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("--out") && err.contains("parent folder does not exist"),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "nothing was measured or printed");
    assert!(!top.exists(), "no parent folder was created");
}
