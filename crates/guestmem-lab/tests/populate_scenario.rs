//! The populate scenario, run tiny: structure of its JSON and Markdown, and that every variant
//! really brought every byte up. No timing is asserted.

use std::time::Duration;

use guestmem_lab::populate::{run_populate, LayoutKind, PopulateLabConfig};
use guestmem_lab::report::write_run;
use guestmem_lab::run::{Order, Protocol};

const TINY_BYTES: u64 = 64 << 20;
const VARIANTS: [&str; 5] = [
    "guestmem-1",
    "guestmem-2",
    "guestmem-pin",
    "qemu-style",
    "ch-style",
];

fn tiny() -> PopulateLabConfig {
    PopulateLabConfig {
        size: TINY_BYTES,
        protocol: Protocol {
            warmup: 0,
            rounds: 1,
            order: Order::Rotate,
        },
        layouts: vec![LayoutKind::Single, LayoutKind::Unequal],
        settle: Duration::ZERO,
        threads: 2,
        methods: false,
        command: "test".into(),
    }
}

#[test]
fn populate_tiny_every_variant_populates_every_byte() {
    let _serial = guestmem_testkit::host_lock();
    let result = run_populate(&tiny()).expect("scenario runs");

    assert_eq!(result.body.layouts.len(), 2);
    for layout in &result.body.layouts {
        assert_eq!(layout.region_sizes.iter().sum::<u64>(), TINY_BYTES);
        let names: Vec<&str> = layout.variants.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, VARIANTS);
        for v in &layout.variants {
            assert_eq!(v.samples.len(), 1, "{}", v.name);
            assert_eq!(v.seconds.n, 1, "{}", v.name);
            let s = &v.samples[0].sample;
            assert_eq!(s.size, TINY_BYTES, "{}", v.name);
            assert_eq!(s.resident, TINY_BYTES, "{} on {:?}", v.name, layout.layout);
            assert_eq!(s.mappings, layout.region_sizes.len(), "{}", v.name);
            assert!(
                s.huge_span <= TINY_BYTES && s.huge <= s.huge_span,
                "{}",
                v.name
            );
        }
        let pin = &layout.variants[2].samples[0].sample;
        assert_eq!(pin.locked, TINY_BYTES, "guestmem-pin locks every byte");
        // guestmem keeps every region congruent: its whole span is 2 MiB pages' to take.
        assert_eq!(layout.variants[1].samples[0].sample.huge_span, TINY_BYTES);
    }
}

/// The other ways (what the old populate_lab example compared): the touch fallback and
/// per-chunk pinning populate every byte too, and the pinned one locks every byte.
#[test]
fn populate_methods_touch_and_per_chunk_pin_populate_every_byte() {
    let _serial = guestmem_testkit::host_lock();
    let result = run_populate(&PopulateLabConfig {
        layouts: vec![LayoutKind::Single],
        methods: true,
        ..tiny()
    })
    .expect("scenario runs");
    let layout = &result.body.layouts[0];
    let names: Vec<&str> = layout.variants.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(&names[5..], ["guestmem-touch-2", "guestmem-pin-chunks"]);
    for v in &layout.variants[5..] {
        assert_eq!(v.samples[0].sample.resident, TINY_BYTES, "{}", v.name);
    }
    assert_eq!(layout.variants[6].samples[0].sample.locked, TINY_BYTES);
}

#[test]
fn populate_tiny_writes_json_and_markdown_run_folder() {
    let _serial = guestmem_testkit::host_lock();
    let result = run_populate(&PopulateLabConfig {
        layouts: vec![LayoutKind::Unequal],
        ..tiny()
    })
    .expect("scenario runs");
    let base = std::env::temp_dir().join(format!("guestmem-lab-test-{}", std::process::id()));

    let dir = write_run(&result, &base).expect("run folder written");

    assert!(dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .ends_with("-populate"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).unwrap()).unwrap();
    assert_eq!(json["scenario"], "populate");
    assert_eq!(json["seeds"], serde_json::json!(["000", "001"]));
    for key in [
        "command",
        "git_commit",
        "kernel",
        "cpu_model",
        "cpus",
        "started_utc",
    ] {
        assert!(json["run"].get(key).is_some(), "run.{key}");
    }
    assert_eq!(json["settings"]["size"], TINY_BYTES);
    let v = &json["layouts"][0]["variants"][0];
    for key in [
        "name",
        "seconds",
        "gbps_at_median",
        "time_vs_guestmem_n",
        "huge_coverage_median",
    ] {
        assert!(v.get(key).is_some(), "variant.{key}");
    }
    let svg = std::fs::read_to_string(dir.join("plot.svg")).expect("plot written");
    assert!(svg.starts_with("<svg"));
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("## unequal (32M + 16M + 8M + 2 x 4M)"), "{md}");
    assert!(md.contains("| variant | threads | median s |"));
    for name in VARIANTS {
        assert!(md.contains(&format!("| {name} |")), "{name} row");
    }
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn populate_zero_rounds_is_refused_before_measuring() {
    let cfg = PopulateLabConfig {
        protocol: Protocol {
            rounds: 0,
            ..tiny().protocol
        },
        ..tiny()
    };
    let e = run_populate(&cfg).unwrap_err().to_string();
    assert!(e.contains("populate") && e.contains("round"), "{e}");
}
