// Loaded with `node --import`: fails any import of an AI framework made by this package's own
// modules (dist/src) other than the one named by FRAMEWORK_ALLOWED (a specifier prefix), and
// makes the packages named in HIDE_PACKAGES (comma-separated) look not installed to everyone.
import { register } from "node:module";

const hooks = `
const FRAMEWORKS = /^(ai|ai\\/.*|@langchain\\/.*|@openai\\/.*)$/;
export async function resolve(specifier, context, next) {
  if ((process.env.HIDE_PACKAGES ?? "").split(",").includes(specifier)) {
    const e = new Error("Cannot find package '" + specifier + "' (hidden by the test)");
    e.code = "ERR_MODULE_NOT_FOUND";
    throw e;
  }
  const allowed = process.env.FRAMEWORK_ALLOWED ?? "";
  if (
    FRAMEWORKS.test(specifier) &&
    (context.parentURL ?? "").includes("/dist/src/") &&
    (allowed === "" || !specifier.startsWith(allowed))
  ) {
    throw new Error("forbidden import of " + specifier + " by " + context.parentURL);
  }
  return next(specifier, context);
}`;
register(`data:text/javascript,${encodeURIComponent(hooks)}`);
