//! The overview's charts, drawn as SVG on the server: the backlog and the
//! oldest pending event's age over the last 30 minutes (from the console's
//! own samples), and deliveries per minute.

use crate::samples::Sample;
use crate::views::age;
use chrono::{DateTime, Utc};
use maud::{html, Markup};

/// A chart's drawing area inside its 600×200 view box: room on the left for
/// the value axis's labels and at the bottom for the time axis's.
const CHART_W: f64 = 600.0;
const CHART_H: f64 = 200.0;
const PLOT_LEFT: f64 = 76.0;
const PLOT_RIGHT: f64 = 592.0;
const PLOT_TOP: f64 = 12.0;
const PLOT_BOTTOM: f64 = 170.0;

/// The smallest "round" number (1, 2 or 5 × 10ⁿ) at or above `max`, at least 1.
fn nice_ceiling(max: f64) -> f64 {
    if max <= 1.0 {
        return 1.0;
    }
    let magnitude = 10_f64.powf(max.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|v| *v >= max)
        .unwrap_or(10.0 * magnitude)
}

/// The axes of a chart: value labels (0, half, top) and time labels (start,
/// middle, end), with light grid lines.
fn axes(
    top: f64,
    label: &dyn Fn(f64) -> String,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> Markup {
    let mid = start + (end - start) / 2;
    html! {
        @for (value, y) in [(0.0, PLOT_BOTTOM), (top / 2.0, (PLOT_TOP + PLOT_BOTTOM) / 2.0), (top, PLOT_TOP)] {
            line.grid x1=(PLOT_LEFT) y1=(y) x2=(PLOT_RIGHT) y2=(y) {}
            text.tick x=(PLOT_LEFT - 8.0) y=(y + 6.0) text-anchor="end" { (label(value)) }
        }
        line.axis x1=(PLOT_LEFT) y1=(PLOT_TOP) x2=(PLOT_LEFT) y2=(PLOT_BOTTOM) {}
        line.axis x1=(PLOT_LEFT) y1=(PLOT_BOTTOM) x2=(PLOT_RIGHT) y2=(PLOT_BOTTOM) {}
        @for (t, x, anchor) in [(start, PLOT_LEFT, "start"), (mid, (PLOT_LEFT + PLOT_RIGHT) / 2.0, "middle"), (end, PLOT_RIGHT, "end")] {
            text.tick x=(x) y=(CHART_H - 6.0) text-anchor=(anchor) { (t.format("%H:%M")) }
        }
    }
}

/// One line of a line chart.
struct Series<'a> {
    name: &'a str,
    class: &'a str,
    points: Vec<(DateTime<Utc>, f64)>,
}

/// Lines over the last [`crate::samples::HISTORY`], up to the last sample.
fn line_chart(
    id: &str,
    label: &str,
    series: &[Series<'_>],
    value: &dyn Fn(f64) -> String,
) -> Markup {
    let end = series
        .iter()
        .filter_map(|s| s.points.last().map(|p| p.0))
        .max()
        .unwrap_or_else(Utc::now);
    let start = end - chrono::Duration::from_std(crate::samples::HISTORY).unwrap_or_default();
    let span = (end - start).num_milliseconds().max(1) as f64;
    let max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    let top = nice_ceiling(max);
    let x = |t: DateTime<Utc>| {
        PLOT_LEFT + (t - start).num_milliseconds().max(0) as f64 / span * (PLOT_RIGHT - PLOT_LEFT)
    };
    let y = |v: f64| PLOT_BOTTOM - v / top * (PLOT_BOTTOM - PLOT_TOP);
    html! {
        figure.chart {
            svg #(id) viewBox={"0 0 " (CHART_W) " " (CHART_H)} role="img" aria-label=(label) {
                (axes(top, value, start, end))
                @for s in series {
                    @let pts: Vec<String> = s.points.iter().map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v))).collect();
                    @if pts.len() == 1 {
                        circle class=(s.class) data-series=(s.name) cx=(format!("{:.1}", x(s.points[0].0))) cy=(format!("{:.1}", y(s.points[0].1))) r="3" {}
                    } @else {
                        polyline class=(s.class) data-series=(s.name) points=(pts.join(" ")) {}
                    }
                }
            }
            figcaption.legend {
                @for s in series {
                    span { i class={"swatch " (s.class)} {} (s.name) ": " strong { (s.points.last().map_or_else(String::new, |p| value(p.1))) } }
                }
            }
        }
    }
}

pub(crate) fn backlog_chart(history: &[Sample]) -> Markup {
    let series = |name, class, f: fn(&Sample) -> i64| Series {
        name,
        class,
        points: history.iter().map(|s| (s.at, f(s) as f64)).collect(),
    };
    line_chart(
        "backlog-chart",
        "Pending, retrying and dead-letter events over the last 30 minutes",
        &[
            series("pending", "s-pending", |s| s.backlog.pending),
            series("retrying", "s-retrying", |s| s.backlog.retrying),
            series("dead letters", "s-dead", |s| s.backlog.dead_letters),
        ],
        &|v| format!("{v:.0}"),
    )
}

pub(crate) fn age_chart(history: &[Sample]) -> Markup {
    line_chart(
        "age-chart",
        "Age of the oldest pending event over the last 30 minutes",
        &[Series {
            name: "oldest pending",
            class: "s-age",
            points: history
                .iter()
                .map(|s| (s.at, s.backlog.oldest_pending_age_seconds.unwrap_or(0.0)))
                .collect(),
        }],
        &age,
    )
}

pub(crate) fn rate_chart(rate: &[(DateTime<Utc>, i64)]) -> Markup {
    let peak = rate.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let top = nice_ceiling(peak as f64);
    let n = rate.len().max(1);
    let slot = (PLOT_RIGHT - PLOT_LEFT) / n as f64;
    let bar = (slot * 0.8).max(1.0);
    let label = format!(
        "Events delivered per minute over the last {} minutes; peak {} per minute",
        rate.len(),
        peak
    );
    let start = rate.first().map_or_else(Utc::now, |r| r.0);
    let end = rate.last().map_or_else(Utc::now, |r| r.0);
    html! {
        figure.chart {
            svg #rate-chart viewBox={"0 0 " (CHART_W) " " (CHART_H)} role="img" aria-label=(label) {
                (axes(top, &|v| format!("{v:.0}"), start, end))
                @for (i, (minute, count)) in rate.iter().enumerate() {
                    @let h = if *count == 0 { 0.0 } else { (*count as f64 / top * (PLOT_BOTTOM - PLOT_TOP)).max(2.0) };
                    rect x=(format!("{:.1}", PLOT_LEFT + i as f64 * slot + (slot - bar) / 2.0)) y=(format!("{:.1}", PLOT_BOTTOM - h))
                        width=(format!("{bar:.1}")) height=(format!("{h:.1}")) {
                        title { (minute.format("%H:%M UTC")) ": " (count) }
                    }
                }
            }
            figcaption {
                "Events delivered per minute (UTC); peak " strong { (peak) } " per minute."
            }
        }
    }
}
