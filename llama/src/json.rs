//! JSON read from a checkpoint, refusing what serde would read ambiguously: an object that gives a
//! key twice (serde's maps, `serde_json::Value` included, keep the last silently). An ambiguous
//! config or header is an error naming the key, never the value one reader happened to keep.

use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::fmt;

/// `text` as a JSON value, refusing a key given twice in any object at any depth.
pub(crate) fn parse_unique(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str::<Unique>(text).map(|u| u.0)
}

/// A JSON value with no object that gives a key twice.
struct Unique(Value);

impl<'de> Deserialize<'de> for Unique {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueVisitor)
    }
}

struct UniqueVisitor;

impl<'de> Visitor<'de> for UniqueVisitor {
    type Value = Unique;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Unique, E> {
        Ok(Unique(Value::Bool(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Unique, E> {
        Ok(Unique(Value::from(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Unique, E> {
        Ok(Unique(Value::from(v)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Unique, E> {
        Ok(Unique(Value::from(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Unique, E> {
        Ok(Unique(Value::String(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Unique, E> {
        Ok(Unique(Value::String(v)))
    }
    fn visit_unit<E>(self) -> Result<Unique, E> {
        Ok(Unique(Value::Null))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Unique, A::Error> {
        let mut items = Vec::new();
        while let Some(Unique(v)) = a.next_element()? {
            items.push(v);
        }
        Ok(Unique(Value::Array(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Unique, A::Error> {
        let mut map = Map::new();
        while let Some((k, Unique(v))) = a.next_entry::<String, Unique>()? {
            if map.contains_key(&k) {
                return Err(A::Error::custom(format!("`{k}` is given twice")));
            }
            map.insert(k, v);
        }
        Ok(Unique(Value::Object(map)))
    }
}

/// A JSON object read into a map of typed values, refusing a key given twice.
pub(crate) struct UniqueMap<V>(pub(crate) HashMap<String, V>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Visit<V> {
            type Value = UniqueMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                let mut map = HashMap::new();
                while let Some((k, v)) = a.next_entry::<String, V>()? {
                    if map.contains_key(&k) {
                        return Err(A::Error::custom(format!("`{k}` is given twice")));
                    }
                    map.insert(k, v);
                }
                Ok(UniqueMap(map))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_as_serde_json_reads_them() {
        let text = r#"{"a": 1, "b": [true, null, -2, 0.5, "x", {"c": 18446744073709551615}], "d": {}}"#;
        assert_eq!(parse_unique(text).unwrap(), serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn a_key_given_twice_at_any_depth_is_an_error_naming_it() {
        for (text, key) in [
            (r#"{"hidden_size": 64, "hidden_size": 128}"#, "`hidden_size` is given twice"),
            (r#"{"rope_scaling": {"factor": 8, "factor": 32}}"#, "`factor` is given twice"),
            (r#"[{"a": 1}, {"b": 1, "b": 1}]"#, "`b` is given twice"),
        ] {
            let e = parse_unique(text).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
        let e = serde_json::from_str::<UniqueMap<u32>>(r#"{"w": 1, "w": 2}"#).err().unwrap();
        assert!(e.to_string().contains("`w` is given twice"));
    }
}
