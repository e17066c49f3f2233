//! `application/x-www-form-urlencoded` bodies and query strings, read by hand
//! so that repeated fields (checkboxes) keep every value.

#[derive(Debug, Default)]
pub(crate) struct FormData {
    pairs: Vec<(String, String)>,
}

impl FormData {
    pub fn parse(bytes: &[u8]) -> Self {
        Self {
            pairs: url::form_urlencoded::parse(bytes).into_owned().collect(),
        }
    }

    /// The first value of `name`, trimmed; `None` when absent or blank.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// Every value of `name`.
    pub fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.pairs
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_fields_keep_every_value() {
        let f = FormData::parse(b"ids=a&ids=b&csrf=x%20y&empty=+");
        assert_eq!(f.all("ids").collect::<Vec<_>>(), vec!["a", "b"]);
        assert_eq!(f.get("csrf"), Some("x y"));
        assert_eq!(f.get("empty"), None);
        assert_eq!(f.get("missing"), None);
    }
}
