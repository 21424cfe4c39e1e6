// Validates an OpenAPI document: it must parse as YAML, match the OpenAPI 3.0 schema, and every
// $ref must resolve. Exits 1 with the validator's findings otherwise.
import SwaggerParser from "@apidevtools/swagger-parser";

const file = process.argv[2];
try {
  const api = await SwaggerParser.validate(file);
  console.log(`${file}: valid OpenAPI ${api.openapi}, ${Object.keys(api.paths).length} paths`);
} catch (err) {
  console.error(`${file} is not a valid OpenAPI document:\n${err.message}`);
  process.exit(1);
}
