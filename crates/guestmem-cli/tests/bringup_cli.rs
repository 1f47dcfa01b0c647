//! The real `guestmem bringup` binary, end to end.

use std::process::Command;

fn guestmem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_guestmem"))
}

#[test]
fn bringup_json_reports_what_the_kernel_did() {
    let out = guestmem()
        .args([
            "bringup",
            "--size",
            "256M",
            "--regions",
            "3",
            "--threads",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = &v["report"];
    assert_eq!(r["bytes"], 256u64 << 20);
    assert_eq!(r["regions"], 3);
    assert_eq!(v["layout"].as_array().unwrap().len(), 3);
    let usage = r["usage"].as_array().unwrap();
    let sum = |k: &str| usage.iter().map(|u| u[k].as_u64().unwrap()).sum::<u64>();
    // Every byte resident; with THP advice in madvise mode, all of the aligned span huge.
    assert_eq!(sum("resident"), 256 << 20);
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap();
    if !thp.contains("[never]") {
        assert_eq!(sum("huge"), sum("huge_span"));
    }
    // Pinned when the process may lock that much (root here), and then all of it locked.
    if r["pin"] == "up-front" {
        assert_eq!(sum("locked"), 256 << 20);
    }
    let phases: Vec<&str> = r["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(phases.contains(&"populate"), "{phases:?}");
    for row in v["layout"].as_array().unwrap() {
        let (g, h) = (
            row["guest_addr"].as_u64().unwrap(),
            row["host_addr"].as_u64().unwrap(),
        );
        assert_eq!(
            g % (2 << 20),
            h % (2 << 20),
            "host and guest congruent mod 2 MiB"
        );
    }
}

#[test]
fn bringup_refuses_bad_input_before_touching_memory() {
    for args in [
        vec!["bringup", "--threads", "0"],
        vec!["bringup", "--size", "64Q"],
        vec!["bringup", "--size", "1T"],
        vec!["bringup", "--size", "3M", "--regions", "2"],
    ] {
        let out = guestmem().args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.is_empty(), "{args:?}: no error message");
    }
    // A layout file with overlapping regions names both.
    let path = std::env::temp_dir().join(format!("guestmem-cli-overlap-{}", std::process::id()));
    std::fs::write(
        &path,
        r#"[{"addr": 0, "size": "64M"}, {"addr": "32M", "size": "64M"}]"#,
    )
    .unwrap();
    let out = guestmem()
        .args(["bringup", "--layout", path.to_str().unwrap()])
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("overlaps") && err.contains("0x2000000"),
        "{err}"
    );
}

/// A memory cgroup made for one test and removed after it (cgroup v1 `memory`, or v2).
struct TestCgroup {
    dir: std::path::PathBuf,
}

impl TestCgroup {
    /// A cgroup limited to `limit` bytes, or `None` (with the reason printed) where none can
    /// be made here.
    fn with_limit(limit: u64) -> Option<TestCgroup> {
        let name = format!("guestmem-test-{}", std::process::id());
        let (dir, file) = if std::path::Path::new("/sys/fs/cgroup/memory/cgroup.procs").exists() {
            (
                std::path::Path::new("/sys/fs/cgroup/memory").join(&name),
                "memory.limit_in_bytes",
            )
        } else {
            (
                std::path::Path::new("/sys/fs/cgroup").join(&name),
                "memory.max",
            )
        };
        if let Err(e) = std::fs::create_dir(&dir) {
            guestmem_testkit::skip(format_args!(
                "cannot make a memory cgroup at {} ({e}); needs root and cgroupfs",
                dir.display()
            ));
            return None;
        }
        let cg = TestCgroup { dir };
        if let Err(e) = std::fs::write(cg.dir.join(file), limit.to_string()) {
            guestmem_testkit::skip(format_args!("cannot set {file} ({e})"));
            return None;
        }
        Some(cg)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!("could not remove {}: {e}", self.dir.display());
        }
    }
}

#[test]
fn bringup_past_the_memory_cgroup_limit_is_refused_not_oom_killed() {
    let Some(cg) = TestCgroup::with_limit(256 << 20) else {
        return;
    };
    // The child joins the cgroup, then becomes guestmem asking for 1 GiB.
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {} bringup --size 1G",
        cg.dir.display(),
        env!("CARGO_BIN_EXE_guestmem")
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("memory cgroup")
            && err.contains(&cg.dir.display().to_string())
            && err.contains(&(256u64 << 20).to_string())
            && err.contains("already uses"),
        "{err}"
    );
}

#[test]
fn bringup_pin_auto_without_cap_ipc_lock_goes_on_unpinned_and_up_front_refuses() {
    let available = Command::new("setpriv").arg("--version").output().is_ok()
        && Command::new("prlimit").arg("--version").output().is_ok();
    if !available {
        guestmem_testkit::skip(format_args!(
            "needs setpriv and prlimit (util-linux) to drop CAP_IPC_LOCK"
        ));
        return;
    }
    let run = |pin: &str| {
        Command::new("prlimit")
            .args(["--memlock=65536:65536", "setpriv", "--inh-caps=-ipc_lock"])
            .args(["--bounding-set=-ipc_lock", env!("CARGO_BIN_EXE_guestmem")])
            .args([
                "bringup",
                "--size",
                "64M",
                "--regions",
                "1",
                "--json",
                "--pin",
                pin,
            ])
            .output()
            .unwrap()
    };
    let out = run("auto");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["report"]["pin"], "none");
    let note = v["report"]["pin_note"].as_str().unwrap_or_default();
    assert!(note.contains("RLIMIT_MEMLOCK is 65536"), "{note}");
    assert_eq!(v["report"]["process"]["locked"], 0);

    let out = run("up-front");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("RLIMIT_MEMLOCK is 65536"), "{err}");
}
