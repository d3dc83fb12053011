// The JSON form of @grafana/schema's types. The schema declares some fields as TypeScript string
// enums (FieldColorModeId, ThresholdsMode, MappingType, ...), which a string in a JSON file can
// never be assigned to, though the enum's values are exactly the strings Grafana writes. Wire<T>
// turns every string enum into the union of its values and leaves the rest of T as it is: object
// shapes, required fields, literal unions ("row", "query", ...), numeric enums, and the excess-
// property check of an object literal (an unknown key is an error).
export type Wire<T> = T extends string
  ? `${T}`
  : T extends readonly (infer U)[]
    ? Wire<U>[]
    : T extends object
      ? { [K in keyof T]: Wire<T[K]> }
      : T;
