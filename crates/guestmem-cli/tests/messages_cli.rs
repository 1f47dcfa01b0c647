//! The CLI's refusals, end to end: each says what is wrong, and nothing runs that should not.

use std::process::{Command, Stdio};

fn guestmem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_guestmem"))
}

/// Runs `args`; returns (success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let out = guestmem().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bringup_size_that_overflows_says_too_large() {
    let (ok, err) = run(&["bringup", "--size", "99999999999G"]);
    assert!(!ok);
    assert!(
        err.contains("too large") && !err.contains("expected a number"),
        "{err}"
    );
}

#[test]
fn bringup_empty_layout_file_is_refused() {
    let path = std::env::temp_dir().join(format!("guestmem-cli-empty-{}.json", std::process::id()));
    std::fs::write(&path, "[]").unwrap();
    let (ok, err) = run(&["bringup", "--layout", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    assert!(!ok);
    assert!(err.contains("no regions"), "{err}");
}

#[test]
fn bringup_json_into_a_closed_pipe_exits_zero_quietly() {
    // As `guestmem bringup --json | head -c 10`, with the reader gone before the first write.
    let mut child = guestmem()
        .args(["bringup", "--size", "64M", "--regions", "1", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {err}", out.status);
    assert!(!err.contains("Broken pipe"), "{err}");
}
