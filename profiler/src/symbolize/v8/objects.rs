//! A JavaScript object's own properties, read out of process: what a
//! request's objects hold (`req.route.path`, `req.method`), for
//! [`super::express`].
//!
//! In: a tagged pointer to a JS object in the target's heap and a
//! property name. Out: the property's tagged value, or why none.
//!
//! How (V8's object model; every offset and bit field from the binary's
//! postmortem metadata, [`ObjectMeta`]): an object's map says whether its
//! properties are *fast* or a *dictionary*.
//! - Fast: the map's descriptor array lists the map's own properties as
//!   (key, details, value) triples; a data property's details give its
//!   field index, in the object itself (the first
//!   `instance_size - inobject_start` fields, after the header) or, past
//!   those, in the object's out-of-object `PropertyArray`; a constant
//!   (location "descriptor") keeps its value in the triple.
//! - Dictionary (`Object.create(null)`, objects that had properties
//!   deleted or too many added): a `NameDictionary`, a hash table whose
//!   entries are (key, value, details) after a fixed prefix; scanned whole
//!   (bounded), never hashed (the hash function is seeded per process).
//!
//! Every object read is checked by its instance type; every count is
//! bounded; an accessor (a getter) is never run, only reported.
//! The function that made an object ([`JsResolver::constructor`]) is its
//! map's `constructor_or_back_pointer`, followed back through the maps of
//! its transition tree to the root map's constructor.

use std::collections::HashMap;

use super::{JsResolver, MAX_NAME, MAX_STRING_DEPTH, smi, untag};
use crate::model::Frame;
use crate::os::memory::ReadMemory;

/// Most descriptors (fast properties) read of one map.
const MAX_DESCRIPTORS: u64 = 256;
/// Largest dictionary capacity scanned.
const MAX_DICTIONARY: u64 = 1024;
/// Most maps followed back to a root map.
const MAX_BACK_POINTERS: usize = 64;

/// Where V8 keeps an object's properties: the metadata the reads use.
#[derive(Clone, Debug)]
pub struct ObjectMeta {
    map_bit_field3: u64,
    dictionary_shift: u32,
    own_descriptors_mask: u32,
    own_descriptors_shift: u32,
    map_instance_size_words: u64,
    map_inobject_start: u64,
    map_descriptors: u64,
    map_constructor: u64,
    properties: u64,
    descriptors_header: u64,
    desc_size: u64,
    desc_key: u64,
    desc_details: u64,
    desc_value: u64,
    index_mask: u64,
    index_shift: u32,
    location_mask: u64,
    location_field: u64,
    kind_mask: u64,
    kind_data: u64,
    dict_first_entry: u64,
    dict_entry_size: u64,
    t_map: u16,
    t_js_object: u16,
    t_property_array: u16,
    t_symbol: u16,
    symbol_name: u64,
}

impl ObjectMeta {
    /// From the binary's `v8dbg_*` values (`vals`, keyed by full symbol
    /// name). Err: the names of the values it lacks.
    pub fn read(vals: &HashMap<String, i64>) -> Result<ObjectMeta, String> {
        let mut values = super::Values::new(vals);
        let mut get = |names: &[&str]| values.get(names);
        let meta = ObjectMeta {
            map_bit_field3: get(&["class_Map__bit_field3__int"]) as u64,
            dictionary_shift: get(&["bit_field3_is_dictionary_map_shift"]) as u32,
            own_descriptors_mask: get(&["bit_field3_number_of_own_descriptors_mask"]) as u32,
            own_descriptors_shift: get(&["bit_field3_number_of_own_descriptors_shift"]) as u32,
            map_instance_size_words: get(&["class_Map__instance_size_in_words__char"]) as u64,
            map_inobject_start: get(&[
                "class_Map__inobject_properties_start_or_constructor_function_index__char",
            ]) as u64,
            map_descriptors: get(&[
                "class_Map__instance_descriptors_offset",
                "class_Map__instance_descriptors__DescriptorArray",
                "class_Map__instance_descriptors__Tagged_DescriptorArray_",
            ]) as u64,
            map_constructor: get(&[
                "class_Map__constructor_or_back_pointer__Object",
                "class_Map__constructor_or_back_pointer__Tagged_Object_",
            ]) as u64,
            properties: get(&[
                "class_JSReceiver__raw_properties_or_hash__Object",
                "class_JSReceiver__raw_properties_or_hash__Tagged_Object_",
            ]) as u64,
            descriptors_header: get(&["class_DescriptorArray__header_size__uintptr_t"]) as u64,
            desc_size: get(&["prop_desc_size"]) as u64,
            desc_key: get(&["prop_desc_key"]) as u64,
            desc_details: get(&["prop_desc_details"]) as u64,
            desc_value: get(&["prop_desc_value"]) as u64,
            index_mask: get(&["prop_index_mask"]) as u64,
            index_shift: get(&["prop_index_shift"]) as u32,
            location_mask: get(&["prop_location_mask"]) as u64,
            location_field: get(&["prop_location_Field"]) as u64,
            kind_mask: get(&["prop_kind_mask"]) as u64,
            kind_data: get(&["prop_kind_Data"]) as u64,
            dict_first_entry: (get(&["namedictionary_prefix_start_index"])
                + get(&["namedictionaryshape_prefix_size"])) as u64,
            dict_entry_size: get(&["namedictionaryshape_entry_size"]) as u64,
            t_map: get(&["type_Map__MAP_TYPE"]) as u16,
            t_js_object: get(&["type_JSObject__JS_OBJECT_TYPE"]) as u16,
            t_property_array: get(&["type_PropertyArray__PROPERTY_ARRAY_TYPE"]) as u16,
            t_symbol: get(&["type_Symbol__SYMBOL_TYPE"]) as u16,
            symbol_name: get(&[
                "class_Symbol__name__Object",
                "class_Symbol__description__Object",
                "class_Symbol__description__Tagged_Object_",
            ]) as u64,
        };
        values
            .done()
            .map_err(|missing| format!("V8's postmortem metadata lacks {missing}"))?;
        if meta.desc_size < 3 || meta.dict_entry_size < 3 || meta.index_mask == 0 {
            return Err(format!(
                "V8's property layout is unexpected (descriptor size {}, dictionary entry \
                 size {}, field index mask {:#x})",
                meta.desc_size, meta.dict_entry_size, meta.index_mask
            ));
        }
        Ok(meta)
    }
}

/// An own property of an object, as read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Property {
    /// A data property's tagged value (a Smi or a heap pointer).
    Value(u64),
    /// The object has no own property of that name.
    Absent,
    /// An accessor (a getter): its value would take running code.
    Accessor,
}

/// Where the objects of one (fast) map keep a property: found once from
/// the map's descriptors, then read from each object of that map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Field `index` (in the object, or past its in-object fields in its
    /// `PropertyArray`).
    Field(u64),
    /// A constant kept in the descriptor: the value.
    Const(u64),
    Absent,
    Accessor,
}

/// Words of an object read at once by [`JsResolver::properties`]: its
/// header and in-object fields (a `Timeout` has 15).
const OBJECT_WORDS: usize = 32;

/// What one read has learnt of the maps it met (a map's address may hold
/// another map after a GC: kept for one read only): for each plain
/// object's fast map, its in-object layout and the slots of the names
/// looked up.
#[derive(Default)]
pub struct Shapes {
    maps: HashMap<u64, Shape>,
}

/// Maps a read learns, at most.
const MAX_SHAPES: usize = 64;

struct Shape {
    /// `instance_size_in_words` and the first in-object field's word.
    size: u64,
    start: u64,
    slots: Vec<(&'static str, Slot)>,
}

impl JsResolver {
    pub(super) fn object_meta(&self) -> Result<&ObjectMeta, String> {
        self.meta.objects.as_ref().map_err(Clone::clone)
    }

    /// The `JS_OBJECT_TYPE` object at tagged `v` (a plain object or a
    /// class's instance): its address and its map's address.
    pub(super) fn js_object(&self, v: u64) -> Result<(u64, u64), String> {
        let m = &self.meta;
        let o = self.object_meta()?;
        let (addr, t) = self
            .typed(v)
            .ok_or_else(|| format!("no object at {v:#x}"))?;
        if t != o.t_js_object {
            return Err(format!("{v:#x} is not a plain object (type {t:#x})"));
        }
        let map = self
            .u64_at(addr + m.map)
            .and_then(|w| untag(m, w))
            .ok_or_else(|| format!("{v:#x}: its map is unreadable"))?;
        Ok((addr, map))
    }

    /// Own property `name` of the plain JS object at tagged `obj`.
    pub fn own_property(&self, obj: u64, name: &str) -> Result<Property, String> {
        let (addr, map) = self.js_object(obj)?;
        match self.map_slot(map, name)? {
            Some(slot) => self.slot_value(addr, map, slot),
            None => self.dictionary_property(addr, name),
        }
    }

    /// Own properties `names` of the plain JS object at tagged `obj`, as
    /// [`Self::own_property`] reads them, for many objects of a few maps
    /// (a list of timers): the object is read once, and what its map says
    /// is learnt once per read (`shapes`).
    pub fn properties<const N: usize>(
        &self,
        obj: u64,
        names: [&'static str; N],
        shapes: &mut Shapes,
    ) -> Result<[Property; N], String> {
        let m = &self.meta;
        let addr = untag(m, obj).ok_or_else(|| format!("{obj:#x} is not an object"))?;
        let mut words = [0u8; OBJECT_WORDS * 8];
        super::read_in_page(&self.mem, addr, &mut words)
            .ok_or_else(|| format!("no object at {obj:#x}"))?;
        let word = |i: u64| {
            (i < OBJECT_WORDS as u64)
                .then(|| u64::from_le_bytes(words[i as usize * 8..][..8].try_into().unwrap()))
        };
        let map_word = word(m.map / 8).unwrap_or(0);
        let Some(map) = untag(m, map_word) else {
            // Moved (a forwarding address) or not an object: the slow way.
            let mut out = [Property::Absent; N];
            for (o, name) in out.iter_mut().zip(names) {
                *o = self.own_property(obj, name)?;
            }
            return Ok(out);
        };
        if !shapes.maps.contains_key(&map) {
            let (_, t) = self
                .typed(obj)
                .ok_or_else(|| format!("no object at {obj:#x}"))?;
            let o = self.object_meta()?;
            if t != o.t_js_object {
                return Err(format!("{obj:#x} is not a plain object (type {t:#x})"));
            }
            let mut b = [0u8; 24];
            self.mem
                .read_into(map, &mut b)
                .map_err(|e| format!("its map: {e}"))?;
            let byte = |off: u64| b.get(off as usize).copied().map(u64::from);
            let bf3 = b
                .get(o.map_bit_field3 as usize..o.map_bit_field3 as usize + 4)
                .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
                .ok_or("its map's bit field 3 is past the bytes read")?;
            if bf3 >> o.dictionary_shift & 1 == 1 {
                let mut out = [Property::Absent; N];
                for (o, name) in out.iter_mut().zip(names) {
                    *o = self.dictionary_property(addr, name)?;
                }
                return Ok(out);
            }
            if shapes.maps.len() >= MAX_SHAPES {
                shapes.maps.clear();
            }
            shapes.maps.insert(
                map,
                Shape {
                    size: byte(o.map_instance_size_words).unwrap_or(0),
                    start: byte(o.map_inobject_start).unwrap_or(0),
                    slots: Vec::new(),
                },
            );
        }
        let mut out = [Property::Absent; N];
        for (o, name) in out.iter_mut().zip(names) {
            let shape = &shapes.maps[&map];
            let slot = match shape.slots.iter().find(|(n, _)| *n == name) {
                Some(&(_, s)) => s,
                None => {
                    let s = self
                        .map_slot(map, name)?
                        .ok_or("its map became a dictionary map")?;
                    if let Some(shape) = shapes.maps.get_mut(&map) {
                        shape.slots.push((name, s));
                    }
                    s
                }
            };
            let shape = &shapes.maps[&map];
            let inobject = match slot {
                Slot::Field(i) if i < shape.size.saturating_sub(shape.start) => {
                    word(shape.start + i)
                }
                _ => None,
            };
            *o = match inobject {
                Some(v) => Property::Value(v),
                // Out of the object, or past the words read.
                None => self.slot_value(addr, map, slot)?,
            };
        }
        Ok(out)
    }

    /// Where objects of `map` keep property `name`; None: a dictionary
    /// map (each object has its own table).
    fn map_slot(&self, map: u64, name: &str) -> Result<Option<Slot>, String> {
        let o = self.object_meta()?;
        let mut b = [0u8; 4];
        self.mem
            .read_into(map + o.map_bit_field3, &mut b)
            .map_err(|e| format!("its map {map:#x}: {e}"))?;
        let bf3 = u32::from_le_bytes(b);
        if bf3 >> o.dictionary_shift & 1 == 1 {
            return Ok(None);
        }
        let own = u64::from((bf3 & o.own_descriptors_mask) >> o.own_descriptors_shift);
        self.fast_slot(map, own, name).map(Some)
    }

    /// The value in `slot` of the object at `addr` with map `map`.
    fn slot_value(&self, addr: u64, map: u64, slot: Slot) -> Result<Property, String> {
        Ok(match slot {
            Slot::Field(index) => Property::Value(self.field(addr, map, index)?),
            Slot::Const(v) => Property::Value(v),
            Slot::Absent => Property::Absent,
            Slot::Accessor => Property::Accessor,
        })
    }

    /// A string property's text (`Absent` and non-strings are `None`).
    pub fn string_property(&self, obj: u64, name: &str) -> Result<Option<String>, String> {
        match self.own_property(obj, name)? {
            Property::Value(v) => Ok(self.string(v, MAX_NAME, MAX_STRING_DEPTH)),
            Property::Absent | Property::Accessor => Ok(None),
        }
    }

    /// Is property key `key` named `name`? A key is an internalized
    /// string, or a symbol: a class's private field (`#heap`) is a private
    /// symbol whose description is its name, and only a `#name` is looked
    /// for among symbols.
    fn key_is(&self, key: u64, name: &str) -> bool {
        if untag(&self.meta, key).is_none() {
            return false;
        }
        if !name.starts_with('#') {
            return self
                .string(key, name.len() as u32, MAX_STRING_DEPTH)
                .is_some_and(|k| k == name);
        }
        let Ok(o) = self.object_meta() else {
            return false;
        };
        match self.typed(key) {
            Some((addr, t)) if t == o.t_symbol => self
                .u64_at(addr + o.symbol_name)
                .and_then(|d| self.string(d, name.len() as u32, MAX_STRING_DEPTH))
                .is_some_and(|k| k == name),
            _ => false,
        }
    }

    fn fast_slot(&self, map: u64, own: u64, name: &str) -> Result<Slot, String> {
        let m = &self.meta;
        let o = self.object_meta()?;
        if own == 0 {
            return Ok(Slot::Absent);
        }
        if own > MAX_DESCRIPTORS {
            return Err(format!("{own} properties, over the {MAX_DESCRIPTORS} read"));
        }
        let descriptors = self
            .u64_at(map + o.map_descriptors)
            .and_then(|d| untag(m, d))
            .ok_or("its descriptors are unreadable")?;
        let words = (own * o.desc_size) as usize;
        let raw = self
            .mem
            .read_bytes(descriptors + o.descriptors_header, words * 8)
            .map_err(|e| format!("its descriptors: {e}"))?;
        let word = |i: u64| u64::from_le_bytes(raw[i as usize * 8..][..8].try_into().unwrap());
        for i in 0..own {
            let e = i * o.desc_size;
            if !self.key_is(word(e + o.desc_key), name) {
                continue;
            }
            let details =
                smi(word(e + o.desc_details)).ok_or("a property's details are not a Smi")? as u64;
            if details & o.kind_mask != o.kind_data {
                return Ok(Slot::Accessor);
            }
            if details & o.location_mask != o.location_field {
                return Ok(Slot::Const(word(e + o.desc_value)));
            }
            return Ok(Slot::Field((details & o.index_mask) >> o.index_shift));
        }
        Ok(Slot::Absent)
    }

    /// Field `index` of the object at `addr` with map `map`: in the object,
    /// or in its `PropertyArray`.
    fn field(&self, addr: u64, map: u64, index: u64) -> Result<u64, String> {
        let m = &self.meta;
        let o = self.object_meta()?;
        let mut b = [0u8; 1];
        let mut byte = |off: u64| -> Result<u64, String> {
            self.mem
                .read_into(map + off, &mut b)
                .map_err(|e| format!("its map: {e}"))?;
            Ok(u64::from(b[0]))
        };
        let size = byte(o.map_instance_size_words)?;
        let start = byte(o.map_inobject_start)?;
        let inobject = size.saturating_sub(start);
        if index < inobject {
            return self
                .u64_at(addr + (start + index) * 8)
                .ok_or_else(|| "an in-object field is unreadable".into());
        }
        let props = self
            .u64_at(addr + o.properties)
            .ok_or("its property array is unreadable")?;
        let (pa, t) = self.typed(props).ok_or("its property array moved")?;
        if t != o.t_property_array {
            return Err(format!(
                "its properties are not a PropertyArray (type {t:#x})"
            ));
        }
        // PropertyArray: map, then length (and hash) as a Smi, then the
        // fields, as a FixedArray's header.
        let len = self
            .u64_at(pa + m.fixed_length)
            .and_then(smi)
            .ok_or("its property array's length is unreadable")? as u64
            & 0x3ff;
        let i = index - inobject;
        if i >= len {
            return Err(format!(
                "field {index} is past its {len} out-of-object fields"
            ));
        }
        self.u64_at(pa + m.fixed_data + i * 8)
            .ok_or_else(|| "an out-of-object field is unreadable".into())
    }

    fn dictionary_property(&self, addr: u64, name: &str) -> Result<Property, String> {
        let m = &self.meta;
        let o = self.object_meta()?;
        let dict = self
            .u64_at(addr + o.properties)
            .ok_or("its property dictionary is unreadable")?;
        let (d, _) = self.typed(dict).ok_or("its property dictionary moved")?;
        // A hash table is a FixedArray: [count, deleted, capacity, prefix…,
        // entries…].
        let cap_at = d + m.fixed_data + 2 * 8;
        let capacity =
            self.u64_at(cap_at)
                .and_then(smi)
                .filter(|&c| c > 0)
                .ok_or("its property dictionary's capacity is unreadable")? as u64;
        if capacity > MAX_DICTIONARY {
            return Err(format!(
                "a dictionary of {capacity} entries, over the {MAX_DICTIONARY} read"
            ));
        }
        let words = (capacity * o.dict_entry_size) as usize;
        let raw = self
            .mem
            .read_bytes(d + m.fixed_data + o.dict_first_entry * 8, words * 8)
            .map_err(|e| format!("its property dictionary: {e}"))?;
        let word = |i: u64| u64::from_le_bytes(raw[i as usize * 8..][..8].try_into().unwrap());
        for i in 0..capacity {
            let e = i * o.dict_entry_size;
            // Empty and deleted entries hold `undefined` and the hole:
            // oddballs, not strings.
            if !self.key_is(word(e), name) {
                continue;
            }
            let details = smi(word(e + 2)).ok_or("a property's details are not a Smi")? as u64;
            if details & o.kind_mask != o.kind_data {
                return Ok(Property::Accessor);
            }
            return Ok(Property::Value(word(e + 1)));
        }
        Ok(Property::Absent)
    }

    /// The function that made the plain object at tagged `obj` (`new
    /// Route(…)` → `Route (route.js:41)`), with its script.
    pub fn constructor(&mut self, obj: u64) -> Result<Frame, String> {
        let m = self.meta.clone();
        let o = self.object_meta()?.clone();
        let (_, mut map) = self.js_object(obj)?;
        for _ in 0..MAX_BACK_POINTERS {
            let c = self
                .u64_at(map + o.map_constructor)
                .ok_or("its map's constructor is unreadable")?;
            let (addr, t) = self
                .typed(c)
                .ok_or("its map's constructor is not an object")?;
            if t == o.t_map {
                map = addr;
                continue;
            }
            if t < m.t_jsf_first || t > m.t_jsf_last {
                return Err(format!("made by no function (type {t:#x})"));
            }
            return self
                .resolve(c)
                .ok_or_else(|| "its constructor is unreadable".into());
        }
        Err(format!(
            "over {MAX_BACK_POINTERS} maps back to its constructor"
        ))
    }
}
