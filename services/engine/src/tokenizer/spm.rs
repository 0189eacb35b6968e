//! SentencePiece-style tokenization as llama.cpp does it for GGUF files
//! whose `tokenizer.ggml.model` is `llama` (Gemma, Llama 2, Mistral):
//! user-defined pieces (Gemma's runs of spaces, newlines and tabs, its HTML
//! tags) and, when asked, control tokens are split out of the text first,
//! longest first; each remaining piece has its spaces written as `▁`, then
//! adjacent symbols merge, highest piece score first (leftmost on ties),
//! while the merge is a piece of the vocabulary; what is left over and not
//! a piece becomes byte tokens (`<0x41>`).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// GGUF token types.
pub const TYPE_UNKNOWN: i64 = 2;
pub const TYPE_CONTROL: i64 = 3;
pub const TYPE_USER_DEFINED: i64 = 4;
pub const TYPE_BYTE: i64 = 6;

/// The space marker SentencePiece writes for ' '.
const SPACE: &str = "\u{2581}";

pub struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// Token of each byte value (`<0xXX>`), where the vocabulary has one.
    bytes: [Option<u32>; 256],
    /// User-defined pieces: split out of any text, longest first.
    user: Vec<(String, u32)>,
    /// Control and unknown tokens: split out only when parsing specials.
    control: Vec<(String, u32)>,
}

/// A candidate merge of two adjacent symbols.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// Highest score first; on a tie, the leftmost.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

/// One symbol of the text being merged: `text[start..start + len]`.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub fn new(tokens: &[&str], scores: &[f32], types: &[i64]) -> Spm {
        let ids: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let mut bytes = [None; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied();
        }
        let of_type = |want: &[i64]| {
            let mut v: Vec<(String, u32)> = (tokens.iter().zip(types).enumerate())
                .filter(|(_, (t, ty))| want.contains(ty) && !t.is_empty())
                .map(|(i, (t, _))| (t.to_string(), i as u32))
                .collect();
            v.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
            v
        };
        Spm {
            user: of_type(&[TYPE_USER_DEFINED]),
            control: of_type(&[TYPE_CONTROL, TYPE_UNKNOWN]),
            ids,
            scores: scores.to_vec(),
            bytes,
        }
    }

    /// Token ids of `text` (no BOS).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(t) => self.merge(&t.replace(' ', SPACE), &mut out),
            }
        }
        out
    }

    /// Split `text` at special pieces, each piece longest first over the
    /// fragments left by the longer ones (llama.cpp's
    /// `tokenizer_st_partition`).
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = vec![Fragment::Text(text)];
        let specials = self.user.iter().chain(if parse_special { &self.control[..] } else { &[] });
        let mut all: Vec<&(String, u32)> = specials.collect();
        all.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        for (piece, id) in all {
            if !frags.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(piece.as_str()))) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Text(mut t) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = t.find(piece.as_str()) {
                    if at > 0 {
                        next.push(Fragment::Text(&t[..at]));
                    }
                    next.push(Fragment::Token(*id));
                    t = &t[at + piece.len()..];
                }
                if !t.is_empty() {
                    next.push(Fragment::Text(t));
                }
            }
            frags = next;
        }
        frags
    }

    /// The bigram of symbols `l` and `r`, if their text is a piece.
    fn bigram(&self, text: &str, syms: &[Symbol], l: Option<usize>, r: Option<usize>) -> Option<Bigram> {
        let (left, right) = (l?, r?);
        let (a, b) = (syms[left], syms[right]);
        let piece = &text[a.start..a.start + a.len + b.len];
        let id = *self.ids.get(piece)?;
        Some(Bigram { score: self.scores.get(id as usize).copied().unwrap_or(0.0), left, right, size: piece.len() })
    }

    /// Merge the characters of `text` (spaces already `▁`) into pieces.
    fn merge(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Symbol> = Vec::new();
        for (start, ch) in text.char_indices() {
            let i = syms.len();
            syms.push(Symbol { start, len: ch.len_utf8(), prev: i.checked_sub(1), next: None });
            if i > 0 {
                syms[i - 1].next = Some(i);
            }
        }
        if syms.is_empty() {
            return;
        }
        let mut queue = BinaryHeap::new();
        for i in 1..syms.len() {
            queue.extend(self.bigram(text, &syms, Some(i - 1), Some(i)));
        }
        while let Some(bg) = queue.pop() {
            let (l, r) = (syms[bg.left], syms[bg.right]);
            // Skip a bigram one of whose symbols has merged since.
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.size || l.next != Some(bg.right) {
                continue;
            }
            syms[bg.left].len += r.len;
            syms[bg.right].len = 0;
            syms[bg.left].next = r.next;
            if let Some(n) = r.next {
                syms[n].prev = Some(bg.left);
            }
            queue.extend(self.bigram(text, &syms, syms[bg.left].prev, Some(bg.left)));
            queue.extend(self.bigram(text, &syms, Some(bg.left), syms[bg.left].next));
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(id) => out.push(*id),
                None => out.extend(piece.bytes().filter_map(|b| self.bytes[b as usize])),
            }
            at = s.next;
        }
    }

    /// The bytes a piece stands for: `▁` as a space, `<0xXX>` as its byte.
    pub fn piece_bytes(text: &str, ty: i64) -> Vec<u8> {
        if ty == TYPE_BYTE {
            if let Some(b) = text.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                if let Ok(v) = u8::from_str_radix(b, 16) {
                    return vec![v];
                }
            }
        }
        text.replace(SPACE, " ").into_bytes()
    }
}

enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Spm {
        let tokens = ["<unk>", "<bos>", "<0x41>", "<0xE2>", "\u{2581}", "a", "b", "ab", "\u{2581}ab", "  ", "\n"];
        let scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -1.5, -0.5, 0.0, 0.0];
        let types = [2, 3, 6, 6, 1, 1, 1, 1, 1, 4, 4];
        Spm::new(&tokens, &scores, &types)
    }

    #[test]
    fn merges_by_score_splits_specials_and_falls_back_to_bytes() {
        let s = toy();
        assert_eq!(s.encode(" ab", false), vec![8]);
        assert_eq!(s.encode("ab", false), vec![7]);
        // User-defined pieces always split out; control ones only when asked.
        assert_eq!(s.encode("a  b\n", false), vec![5, 9, 6, 10]);
        assert_eq!(s.encode("<bos>a", true), vec![1, 5]);
        // 'A' has a byte token; 'Z' has none and is dropped.
        assert_eq!(s.encode("A", false), vec![2]);
        assert_eq!(Spm::piece_bytes("<0x41>", TYPE_BYTE), b"A");
        assert_eq!(Spm::piece_bytes("\u{2581}ab", 1), b" ab");
    }
}
