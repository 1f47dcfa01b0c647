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
