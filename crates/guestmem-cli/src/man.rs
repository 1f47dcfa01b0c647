//! `guestmem man --out DIR`: the manual pages, made from the same clap definitions that parse
//! the flags (`guestmem.1`, and `guestmem-SUBCOMMAND.1` for each subcommand), for the Debian
//! package (`dist/build-deb`). Hidden: it is a build step, not something an operator runs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args as ClapArgs, CommandFactory};

/// Flags of `guestmem man`.
#[derive(ClapArgs)]
pub struct Args {
    /// The folder the pages are written to (made if missing).
    #[arg(long)]
    out: PathBuf,
}

/// Writes every page.
pub fn run(a: Args) -> Result<()> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("--out {}", a.out.display()))?;
    let cmd = crate::Cli::command();
    write(&a.out, "guestmem", cmd.clone())?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("guestmem-{}", sub.get_name());
        write(
            &a.out,
            &name,
            sub.clone()
                .display_name(name.clone())
                .bin_name(name.replacen('-', " ", 1)),
        )?;
    }
    Ok(())
}

/// `page` as `DIR/NAME.1`.
fn write(dir: &std::path::Path, name: &str, page: clap::Command) -> Result<()> {
    let mut roff = Vec::new();
    clap_mangen::Man::new(page).render(&mut roff)?;
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, roff).with_context(|| format!("write {}", path.display()))?;
    println!("{}", path.display());
    Ok(())
}
