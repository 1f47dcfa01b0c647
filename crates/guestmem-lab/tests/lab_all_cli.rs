//! `guestmem-lab restore` and `guestmem-lab all --quick` end to end: every scenario leaves a
//! run folder with its result, report and plot (or the index says why it could not run).

use std::path::{Path, PathBuf};
use std::process::Command;

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gm-lab-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The run folders directly under `base`.
fn folders(base: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(base)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

fn run(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_guestmem-lab"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn lab_restore_quick_writes_every_variant_checked() {
    let out = out_dir("restore");
    let (ok, stdout, stderr) = run(&[
        "restore",
        "--sizes",
        "8M",
        "--vcpus",
        "1,2",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let dirs = folders(&out);
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let d = &dirs[0];
    for f in ["result.json", "report.md", "plot.svg"] {
        assert!(d.join(f).exists(), "{f} missing in {}", d.display());
    }
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("result.json")).unwrap()).unwrap();
    let vs = r["variants"].as_array().unwrap();
    // 5 ways x 2 reader counts, each measured (every run checked its words against the
    // image, or the scenario would have failed).
    assert_eq!(vs.len(), 10);
    for v in vs {
        assert!(v["seconds"]["median"].as_f64().unwrap() > 0.0, "{v}");
    }
    let fc = vs.iter().find(|v| v["kind"] == "fc-peer").unwrap();
    // One 4 KiB copy per page: 2048 pages of 8 MiB.
    assert_eq!(fc["samples"][0]["fault_blocks"], 2048, "{fc}");
    assert!(
        stdout.contains("| 8 | 2 | serve-uffd-prefetch |"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn lab_all_quick_runs_every_scenario_into_one_folder() {
    let out = out_dir("all");
    let (ok, stdout, stderr) = run(&["all", "--quick", "--out", out.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let top = folders(&out);
    assert_eq!(top.len(), 1, "{top:?}");
    let base = &top[0];
    let index = std::fs::read_to_string(base.join("index.md")).unwrap();
    assert_eq!(index, stdout.split("\nwritten to ").next().unwrap());
    let runs = folders(base);
    for scenario in [
        "populate",
        "guards",
        "faults",
        "translate",
        "restore",
        "vm-restore",
        "fleet",
        "huge-regain",
        "firecracker",
    ] {
        match runs
            .iter()
            .find(|d| d.to_str().unwrap().ends_with(&format!("-{scenario}")))
        {
            Some(d) => {
                for f in ["result.json", "report.md", "plot.svg"] {
                    assert!(d.join(f).exists(), "{scenario}: {f} missing");
                }
                let rel = d.file_name().unwrap().to_str().unwrap();
                assert!(index.contains(&format!("({rel}/plot.svg)")), "{scenario}");
            }
            // A scenario that could not run says why, in the index.
            None => assert!(
                index.contains(&format!("## {scenario}\n\nNot measured: ")),
                "{scenario}: neither results nor a reason\n{index}"
            ),
        }
    }
    // On this kind of machine (root, 2 CPUs, THP madvise, KVM) every scenario runs but
    // firecracker, which --quick leaves out (its rounds take minutes); without a usable
    // /dev/kvm, vm-restore says why it did not.
    assert!(
        index.contains("## firecracker\n\nNot measured: firecracker: quick profile"),
        "{index}"
    );
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    assert_eq!(runs.len(), if kvm { 8 } else { 7 }, "{index}");
    let _ = std::fs::remove_dir_all(&out);
}
