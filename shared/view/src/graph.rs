//! `troupe graph`: a session's DAG, each task with its state and duration, grouped by repo and
//! wave, as Mermaid, Graphviz DOT or SVG.
//!
//! Mermaid and DOT nest a subgraph per repo and, inside it, one per wave, so a renderer draws
//! the grouping. SVG is laid out here by `layout-rs` (no graphviz needed), which has no nested
//! clusters: each node's label names its repo and wave instead, and the layers follow the edges.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use troupe_proto::v1::{Task, TaskState};

/// The output formats of `troupe graph`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A Mermaid `flowchart` (renders in GitHub and GitLab Markdown).
    Mermaid,
    /// Graphviz DOT (`dot -Tpng` and friends).
    Dot,
    /// A standalone SVG picture.
    Svg,
}

/// One task as the picture shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub id: String,
    pub title: String,
    pub state: TaskState,
    /// Run time: from start to finish, or to `now` while it runs.
    pub duration: Option<std::time::Duration>,
    pub repo: String,
    pub wave: u32,
    pub depends_on: Vec<String>,
}

impl Node {
    /// Reads a task; `now` ends the duration of a task still running.
    pub fn from_task(task: &Task, now: chrono::DateTime<chrono::Utc>) -> Self {
        let time = |ts: &Option<prost_types::Timestamp>| {
            ts.as_ref().and_then(|ts| {
                chrono::DateTime::from_timestamp(ts.seconds, u32::try_from(ts.nanos).ok()?)
            })
        };
        let duration = time(&task.started_at).and_then(|start| {
            let end = time(&task.finished_at).unwrap_or(now);
            (end - start).to_std().ok()
        });
        Self {
            id: task.id.clone(),
            title: task.title.clone(),
            state: TaskState::try_from(task.state).unwrap_or(TaskState::Unspecified),
            duration,
            repo: task.repo.clone(),
            wave: task.wave,
            depends_on: task.depends_on.clone(),
        }
    }

    fn state_name(&self) -> &'static str {
        troupe_proto::names::task_state(self.state)
    }

    /// `completed · 12s`, or the state alone before it starts.
    fn status_line(&self) -> String {
        match self.duration {
            Some(duration) => format!("{} · {}", self.state_name(), human_duration(duration)),
            None => self.state_name().to_owned(),
        }
    }
}

/// Renders the nodes in `format`; `title` names the graph (the session id).
pub fn render(format: Format, title: &str, nodes: &[Node]) -> String {
    match format {
        Format::Mermaid => mermaid(nodes),
        Format::Dot => dot(title, nodes),
        Format::Svg => svg(nodes),
    }
}

/// Nodes grouped by repo (in name order; the default repo's empty name first), then by wave.
fn grouped(nodes: &[Node]) -> BTreeMap<&str, BTreeMap<u32, Vec<&Node>>> {
    let mut groups: BTreeMap<&str, BTreeMap<u32, Vec<&Node>>> = BTreeMap::new();
    for node in nodes {
        groups
            .entry(node.repo.as_str())
            .or_default()
            .entry(node.wave)
            .or_default()
            .push(node);
    }
    groups
}

/// Edges from each dependency to its dependent, for dependencies that are in the graph.
fn edges(nodes: &[Node]) -> Vec<(usize, usize)> {
    let index: BTreeMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| (node.id.as_str(), i))
        .collect();
    nodes
        .iter()
        .enumerate()
        .flat_map(|(to, node)| {
            node.depends_on
                .iter()
                .filter_map(|dep| index.get(dep.as_str()).map(|&from| (from, to)))
                .collect::<Vec<_>>()
        })
        .collect()
}

fn repo_label(repo: &str) -> &str {
    if repo.is_empty() { "default" } else { repo }
}

/// Fill and stroke colours of a state (the same in every format).
fn colours(state: TaskState) -> (&'static str, &'static str) {
    match state {
        TaskState::Completed => ("#c8e6c9", "#2e7d32"),
        TaskState::Failed | TaskState::TimedOut => ("#ffcdd2", "#c62828"),
        TaskState::Running => ("#bbdefb", "#1565c0"),
        TaskState::Ready => ("#e3f2fd", "#1565c0"),
        TaskState::Blocked => ("#fff9c4", "#f9a825"),
        TaskState::Skipped | TaskState::Cancelled => ("#eeeeee", "#757575"),
        _ => ("#ffffff", "#616161"),
    }
}

fn mermaid(nodes: &[Node]) -> String {
    let position: BTreeMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| (node.id.as_str(), i))
        .collect();
    // Mermaid ids are positional (`t0`, `t1`, ...): task ids may hold characters it reserves.
    let escape = |text: &str| text.replace('"', "#quot;");
    let mut out = String::from("flowchart TD\n");
    for (r, (repo, waves)) in grouped(nodes).iter().enumerate() {
        let _ = writeln!(
            out,
            "  subgraph r{r}[\"repo {}\"]",
            escape(repo_label(repo))
        );
        for (wave, members) in waves {
            let _ = writeln!(out, "    subgraph r{r}w{wave}[\"wave {wave}\"]");
            for node in members {
                let _ = writeln!(
                    out,
                    "      t{}[\"{}<br/>{}<br/>{}\"]",
                    position[node.id.as_str()],
                    escape(&node.id),
                    escape(&node.title),
                    escape(&node.status_line())
                );
            }
            out.push_str("    end\n");
        }
        out.push_str("  end\n");
    }
    for (from, to) in edges(nodes) {
        let _ = writeln!(out, "  t{from} --> t{to}");
    }
    let mut states: Vec<TaskState> = nodes.iter().map(|node| node.state).collect();
    states.sort_by_key(|state| *state as i32);
    states.dedup();
    for state in states {
        let (fill, stroke) = colours(state);
        let name = troupe_proto::names::task_state(state);
        let _ = writeln!(out, "  classDef {name} fill:{fill},stroke:{stroke}");
        let members: Vec<String> = nodes
            .iter()
            .enumerate()
            .filter(|(_, node)| node.state == state)
            .map(|(i, _)| format!("t{i}"))
            .collect();
        let _ = writeln!(out, "  class {} {name}", members.join(","));
    }
    out
}

/// A DOT string literal.
fn quoted(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn dot(title: &str, nodes: &[Node]) -> String {
    let mut out = format!("digraph {} {{\n", quoted(title));
    out.push_str(
        "  rankdir=TB;\n  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\"];\n",
    );
    for (r, (repo, waves)) in grouped(nodes).iter().enumerate() {
        let _ = writeln!(out, "  subgraph cluster_r{r} {{");
        let _ = writeln!(
            out,
            "    label={};",
            quoted(&format!("repo {}", repo_label(repo)))
        );
        for (wave, members) in waves {
            let _ = writeln!(out, "    subgraph cluster_r{r}_w{wave} {{");
            let _ = writeln!(out, "      label={};", quoted(&format!("wave {wave}")));
            for node in members {
                let (fill, stroke) = colours(node.state);
                let label = format!("{}\n{}\n{}", node.id, node.title, node.status_line());
                let _ = writeln!(
                    out,
                    "      {} [label={}, fillcolor=\"{fill}\", color=\"{stroke}\", state={}];",
                    quoted(&node.id),
                    quoted(&label),
                    quoted(node.state_name())
                );
            }
            out.push_str("    }\n");
        }
        out.push_str("  }\n");
    }
    for (from, to) in edges(nodes) {
        let _ = writeln!(
            out,
            "  {} -> {};",
            quoted(&nodes[from].id),
            quoted(&nodes[to].id)
        );
    }
    out.push_str("}\n");
    out
}

fn svg(nodes: &[Node]) -> String {
    use layout::backends::svg::SVGWriter;
    use layout::core::base::Orientation;
    use layout::core::color::Color;
    use layout::core::style::StyleAttr;
    use layout::std_shapes::shapes::{Arrow, Element, ShapeKind};
    use layout::topo::layout::VisualGraph;

    if nodes.is_empty() {
        // layout-rs cannot lay out an empty graph; an empty picture says the same.
        return "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"0\" height=\"0\"></svg>\n"
            .to_owned();
    }
    let mut graph = VisualGraph::new(Orientation::TopToBottom);
    let handles: Vec<_> = nodes
        .iter()
        .map(|node| {
            let (fill, stroke) = colours(node.state);
            let label = format!(
                "{}\n{}\n{}\nrepo {} · wave {}",
                node.id,
                node.title,
                node.status_line(),
                repo_label(&node.repo),
                node.wave
            );
            let look = StyleAttr::new(Color::fast(stroke), 2, Some(Color::fast(fill)), 8, 14);
            let size = layout::core::geometry::get_size_for_str(&label, 14);
            graph.add_node(Element::create(
                ShapeKind::new_box(&label),
                look,
                Orientation::TopToBottom,
                size,
            ))
        })
        .collect();
    for (from, to) in edges(nodes) {
        graph.add_edge(Arrow::simple(""), handles[from], handles[to]);
    }
    let mut writer = Bounded {
        svg: SVGWriter::new(),
        extent: (0.0, 0.0),
    };
    graph.do_it(false, false, false, &mut writer);
    writer.finish()
}

/// layout-rs's SVG writer with the picture's size taken from what is drawn: the writer's own
/// size counts each label as ten pixels high per character (layout-rs 0.1.3), so a few tasks
/// gave a picture three times taller than its drawing, a blank gap under it in the web view.
struct Bounded {
    svg: layout::backends::svg::SVGWriter,
    /// The largest x and y drawn to.
    extent: (f64, f64),
}

impl Bounded {
    fn grow(&mut self, x: f64, y: f64) {
        self.extent = (self.extent.0.max(x), self.extent.1.max(y));
    }

    /// The SVG with its size set to the drawing and the writer's margin of 5.
    fn finish(&self) -> String {
        let text = self.svg.finalize();
        let (width, height) = (self.extent.0 + 5.0, self.extent.1 + 5.0);
        let Some(start) = text.find("<svg width=") else {
            return text;
        };
        let Some(end) = text[start..].find(" xmlns=").map(|end| start + end) else {
            return text;
        };
        format!(
            "{}<svg width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\"{}",
            &text[..start],
            &text[end..]
        )
    }
}

impl layout::core::format::RenderBackend for Bounded {
    fn draw_rect(
        &mut self,
        xy: layout::core::geometry::Point,
        size: layout::core::geometry::Point,
        look: &layout::core::style::StyleAttr,
        properties: Option<String>,
        clip: Option<layout::core::format::ClipHandle>,
    ) {
        self.grow(xy.x + size.x, xy.y + size.y);
        self.svg.draw_rect(xy, size, look, properties, clip);
    }

    fn draw_line(
        &mut self,
        start: layout::core::geometry::Point,
        stop: layout::core::geometry::Point,
        look: &layout::core::style::StyleAttr,
        properties: Option<String>,
    ) {
        self.grow(start.x.max(stop.x), start.y.max(stop.y));
        self.svg.draw_line(start, stop, look, properties);
    }

    fn draw_circle(
        &mut self,
        xy: layout::core::geometry::Point,
        size: layout::core::geometry::Point,
        look: &layout::core::style::StyleAttr,
        properties: Option<String>,
    ) {
        self.grow(xy.x + size.x / 2.0, xy.y + size.y / 2.0);
        self.svg.draw_circle(xy, size, look, properties);
    }

    /// A label sits inside its node's box, which is drawn too.
    fn draw_text(
        &mut self,
        xy: layout::core::geometry::Point,
        text: &str,
        look: &layout::core::style::StyleAttr,
    ) {
        self.grow(xy.x, xy.y);
        self.svg.draw_text(xy, text, look);
    }

    fn draw_arrow(
        &mut self,
        path: &[(layout::core::geometry::Point, layout::core::geometry::Point)],
        dashed: bool,
        head: (bool, bool),
        look: &layout::core::style::StyleAttr,
        properties: Option<String>,
        text: &str,
    ) {
        for (a, b) in path {
            self.grow(a.x.max(b.x), a.y.max(b.y));
        }
        self.svg
            .draw_arrow(path, dashed, head, look, properties, text);
    }

    fn create_clip(
        &mut self,
        xy: layout::core::geometry::Point,
        size: layout::core::geometry::Point,
        rounded_px: usize,
    ) -> layout::core::format::ClipHandle {
        self.svg.create_clip(xy, size, rounded_px)
    }
}

/// `850ms`, `12s`, `3m04s`, `1h02m`.
pub fn human_duration(duration: std::time::Duration) -> String {
    let secs = duration.as_secs();
    match secs {
        0 => format!("{}ms", duration.as_millis()),
        1..60 => format!("{secs}s"),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, repo: &str, wave: u32, deps: &[&str], state: TaskState) -> Node {
        Node {
            id: id.to_owned(),
            title: format!("title of \"{id}\""),
            state,
            duration: Some(std::time::Duration::from_secs(65)),
            repo: repo.to_owned(),
            wave,
            depends_on: deps.iter().map(|dep| (*dep).to_owned()).collect(),
        }
    }

    fn sample() -> Vec<Node> {
        vec![
            node("IMPL-1", "", 1, &[], TaskState::Completed),
            node("IMPL-2", "web", 1, &[], TaskState::Failed),
            node("TEST-1", "", 2, &["IMPL-1", "IMPL-9"], TaskState::Pending),
        ]
    }

    #[test]
    fn mermaid_nests_repos_and_waves_and_draws_known_edges() {
        let text = mermaid(&sample());
        assert!(text.starts_with("flowchart TD\n"));
        assert!(text.contains("subgraph r0[\"repo default\"]"), "{text}");
        assert!(text.contains("subgraph r1[\"repo web\"]"), "{text}");
        assert!(text.contains("subgraph r0w2[\"wave 2\"]"), "{text}");
        assert!(
            text.contains("t0[\"IMPL-1<br/>title of #quot;IMPL-1#quot;<br/>completed · 1m05s\"]"),
            "{text}"
        );
        // An edge to a task outside the graph (IMPL-9) is left out.
        assert_eq!(text.matches("-->").count(), 1, "{text}");
        assert!(text.contains("t0 --> t2"), "{text}");
        assert!(text.contains("class t1 failed"), "{text}");
    }

    #[test]
    fn dot_quotes_what_it_must() {
        let text = dot("s-1", &sample());
        assert!(text.contains("label=\"IMPL-1\\ntitle of \\\"IMPL-1\\\"\\ncompleted · 1m05s\""));
        assert!(text.contains("\"IMPL-1\" -> \"TEST-1\";"), "{text}");
        assert_eq!(text.matches("subgraph cluster_r").count(), 5, "{text}");
    }

    #[test]
    fn svg_is_a_picture_of_every_task() {
        let text = svg(&sample());
        assert!(text.contains("<svg"), "{text}");
        for id in ["IMPL-1", "IMPL-2", "TEST-1"] {
            assert!(text.contains(id), "{id} missing");
        }
        assert!(svg(&[]).contains("<svg"));
    }

    /// The picture is as big as its drawing: no blank band under the last row of tasks.
    #[test]
    fn svg_is_as_tall_as_its_drawing() {
        let text = svg(&sample());
        let number = |attribute: &str| -> f64 {
            let at = text.find(&format!("{attribute}=\"")).unwrap() + attribute.len() + 2;
            text[at..text[at..].find('"').unwrap() + at]
                .parse()
                .unwrap()
        };
        // The lowest box's bottom edge.
        let bottom = text
            .match_indices("<rect ")
            .map(|(at, _)| {
                let rect = &text[at..at + text[at..].find("/>").unwrap()];
                let field = |name: &str| -> f64 {
                    let from = rect.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
                    rect[from..from + rect[from..].find('"').unwrap()]
                        .parse()
                        .unwrap()
                };
                field("y") + field("height")
            })
            .fold(0.0, f64::max);
        let height = number("height");
        assert!(bottom > 0.0, "{text}");
        assert!(
            height >= bottom && height <= bottom + 10.0,
            "height {height}, drawing ends at {bottom}"
        );
        assert!(text.contains(&format!("viewBox=\"0 0 {} {height}\"", number("width"))));
    }

    #[test]
    fn durations_read_well() {
        use std::time::Duration;
        assert_eq!(human_duration(Duration::from_millis(850)), "850ms");
        assert_eq!(human_duration(Duration::from_secs(12)), "12s");
        assert_eq!(human_duration(Duration::from_secs(184)), "3m04s");
        assert_eq!(human_duration(Duration::from_secs(3720)), "1h02m");
    }
}
