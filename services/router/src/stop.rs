//! Stop strings over streamed text: text is released only once no stop
//! string can still begin in it, and generation ends before the first
//! occurrence.

/// What to do with newly decoded text.
#[derive(Debug, PartialEq)]
pub struct Step {
    /// Text safe to send now.
    pub emit: String,
    /// A stop string matched: send `emit`, then finish.
    pub stopped: bool,
}

#[derive(Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops, held: String::new() }
    }

    pub fn push(&mut self, text: &str) -> Step {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return Step { emit: std::mem::take(&mut self.held), stopped: false };
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let emit = self.held[..at].to_string();
            self.held.clear();
            return Step { emit, stopped: true };
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        Step { emit, stopped: false }
    }

    /// The end of the stream: whatever is held is plain text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_before_a_match_split_over_pushes() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("hello E"), Step { emit: "hello ".into(), stopped: false });
        assert_eq!(m.push("N"), Step { emit: "".into(), stopped: false });
        assert_eq!(m.push("D and more"), Step { emit: "".into(), stopped: true });
    }

    #[test]
    fn releases_held_text_that_does_not_match() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("a E").emit, "a ");
        assert_eq!(m.push("x").emit, "Ex");
        assert_eq!(m.push("EN").emit, "");
        assert_eq!(m.finish(), "EN");
    }

    #[test]
    fn earliest_match_wins_and_no_stops_passes_everything() {
        let mut m = StopMatcher::new(vec!["b".into(), "a".into()]);
        assert_eq!(m.push("xxabc"), Step { emit: "xx".into(), stopped: true });
        let mut n = StopMatcher::new(vec![]);
        assert_eq!(n.push("é"), Step { emit: "é".into(), stopped: false });
    }
}
