//! One picture per run: each variant's median as a bar, with a whisker from its minimum to its
//! maximum, grouped by layout or region count. SVG, drawn with plotters' SVG backend and no
//! font library (text sizes are estimated), so it builds anywhere the lab does.

use std::path::Path;

use plotters::prelude::*;

use crate::error::LabError;

/// One bar: a variant's median with its spread.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// The variant's name.
    pub label: String,
    /// Median.
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

impl Bar {
    /// A bar for `label` from a summary of samples.
    pub fn of(label: &str, s: &crate::run::Summary) -> Bar {
        Bar {
            label: label.to_string(),
            median: s.median,
            min: s.min,
            max: s.max,
        }
    }
}

/// Bars that belong together (one layout, one region count).
#[derive(Debug, Clone, PartialEq)]
pub struct BarGroup {
    /// The group's title.
    pub title: String,
    /// The bars, in the order shown.
    pub bars: Vec<Bar>,
}

/// Pixels per bar row, and per group heading.
const ROW_PX: u32 = 26;
const GROUP_HEAD_PX: u32 = 60;
const WIDTH_PX: u32 = 900;

/// Draws `groups` as horizontal bars into an SVG file at `path`; `unit` labels the axis.
pub fn write_svg(
    path: &Path,
    title: &str,
    unit: &str,
    groups: &[BarGroup],
) -> Result<(), LabError> {
    let rows: u32 = groups.iter().map(|g| g.bars.len() as u32).sum();
    let height = 60 + groups.len() as u32 * GROUP_HEAD_PX + rows * ROW_PX;
    let err = |e: String| LabError::Plot {
        path: path.to_path_buf(),
        reason: e,
    };
    let root = SVGBackend::new(path, (WIDTH_PX, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let root = root
        .titled(title, ("sans-serif", 20))
        .map_err(|e| err(e.to_string()))?;
    let heights: Vec<u32> = groups
        .iter()
        .map(|g| GROUP_HEAD_PX + g.bars.len() as u32 * ROW_PX)
        .collect();
    let mut area = root;
    for (g, h) in groups.iter().zip(heights) {
        let (top, rest) = area.split_vertically(h);
        area = rest;
        let x_max = g.bars.iter().map(|b| b.max).fold(0.0f64, f64::max) * 1.1;
        let n = g.bars.len();
        let mut chart = ChartBuilder::on(&top)
            .caption(&g.title, ("sans-serif", 15))
            .margin(5)
            .x_label_area_size(38)
            .y_label_area_size(180)
            .build_cartesian_2d(
                0.0..x_max.max(f64::MIN_POSITIVE),
                (0..n as i32).into_segmented(),
            )
            .map_err(|e| err(e.to_string()))?;
        let labels: Vec<String> = g.bars.iter().map(|b| b.label.clone()).collect();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n)
            .y_label_formatter(&|y| match y {
                SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .x_desc(unit)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (i, b) in g.bars.iter().enumerate() {
            let y = i as i32;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [
                        (0.0, SegmentValue::Exact(y)),
                        (b.median, SegmentValue::Exact(y + 1)),
                    ],
                    Palette99::pick(i).mix(0.7).filled(),
                )))
                .map_err(|e| err(e.to_string()))?;
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![
                        (b.min, SegmentValue::CenterOf(y)),
                        (b.max, SegmentValue::CenterOf(y)),
                    ],
                    BLACK.stroke_width(2),
                )))
                .map_err(|e| err(e.to_string()))?;
        }
    }
    area.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_svg_draws_every_label() {
        let path = std::env::temp_dir().join(format!("guestmem-plot-{}.svg", std::process::id()));
        let groups = vec![BarGroup {
            title: "single (4G)".into(),
            bars: vec![
                Bar {
                    label: "guestmem-2".into(),
                    median: 0.26,
                    min: 0.25,
                    max: 0.56,
                },
                Bar {
                    label: "qemu-style".into(),
                    median: 0.28,
                    min: 0.26,
                    max: 0.49,
                },
            ],
        }];
        write_svg(&path, "populate", "seconds", &groups).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        for l in ["guestmem-2", "qemu-style", "single (4G)", "populate"] {
            assert!(svg.contains(l), "{l} missing");
        }
    }
}
