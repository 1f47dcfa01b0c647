//! Human-readable formatting shared by the subcommands.

use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};

/// `bytes` as GiB/MiB/KiB with two decimals.
pub fn bytes(b: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, size) in UNITS {
        if b >= size {
            return format!("{:.2} {name}", b as f64 / size as f64);
        }
    }
    format!("{b} B")
}

/// Writes `value` as pretty JSON and a newline. Serialised first, then written: a closed pipe
/// (`guestmem ... --json | head -c 10`) then comes back as an `io::Error` of kind
/// `BrokenPipe`, which `main` ends quietly with exit 0, rather than wrapped in a
/// `serde_json::Error` it would not recognise.
pub fn write_json(
    w: &mut impl std::io::Write,
    value: &impl serde::Serialize,
) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    w.write_all(text.as_bytes())?;
    Ok(())
}

/// A progress bar over `total` bytes on stderr when it is a terminal, else nothing: the
/// returned callback is then `None` and output stays clean for pipes and logs.
pub fn progress(
    total: u64,
    quiet: bool,
) -> (Option<ProgressBar>, Option<guestmem::populate::Progress>) {
    if quiet || !std::io::stderr().is_terminal() {
        return (None, None);
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    let b = bar.clone();
    (Some(bar), Some(Arc::new(move |done| b.set_position(done))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_picks_largest_unit() {
        assert_eq!(bytes(4 << 30), "4.00 GiB");
        assert_eq!(bytes(3 << 19), "1.50 MiB");
        assert_eq!(bytes(12), "12 B");
    }
}
